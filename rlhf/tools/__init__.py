"""Tools that run around the package rather than in it: `make gpucheck` (gpucheck.py: the stages at their 7B shapes
on a GPU, measured against the plan), `make docker-check` (dockercheck.py: the Dockerfile's static checks) and the
test suite's pre-imported launcher (forkserver.py). No stage imports them."""
