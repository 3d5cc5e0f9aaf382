"""Tools that run around the package rather than in it: `make gpucheck` (gpucheck.py drives the stages at their 7B
shapes on a GPU; gpumetrics.py: throughput and the device checks; gpuprofile.py: where an iteration's time goes;
gpureport.py: the tables; decodebench.py: decoding speed), `make docker-check` (dockercheck.py: the Dockerfile's and
the locks' static checks) and the test suite's pre-imported launcher (forkserver.py). No stage imports them; the
versions they record beside their figures come from rlhf/infra/toolchain.py."""
