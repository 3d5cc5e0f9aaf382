"""Memory: the probes that measure a stage (memprobe.py), the predictor that plans its peak before anything loads
(memplan.py, adding up membytes.py's components for arch.py's model shape), and the CI gate on both (memcheck.py:
`make memcheck`)."""
