"""Memory: the probes that measure a stage (probe.py), the predictor that plans its peak before anything loads
(memplan.py, adding up sizes.py's components for arch.py's model shape), and the CI gate on both (memcheck.py:
`make memcheck`)."""
