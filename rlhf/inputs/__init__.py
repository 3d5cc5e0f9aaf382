"""What a stage loads: data and its formats (data.py, formats.py), tokenizers and models (models.py)."""
