"""What an experiment is: its YAML's schema and sections (config.py, sections.py, online_sections.py), TRL's
field names (trl_names.py) and the stage registry everything reads (stages.py). Imports nothing else of rlhf."""
