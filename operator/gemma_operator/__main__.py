"""`python -m gemma_operator`: the same as `kopf run --standalone --all-namespaces -m gemma_operator.handlers`.

Extra arguments go to `kopf run` (e.g. `--namespace team-a`, `--liveness=http://0.0.0.0:8080/healthz`,
`--verbose`). Without --namespace the operator serves all namespaces.
"""

import sys

from kopf.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    scope = [] if any(a.startswith(("--namespace", "-n", "--all-namespaces", "-A")) for a in args) else ["--all-namespaces"]
    sys.exit(main(["run", "--standalone", *scope, "-m", "gemma_operator.handlers", *args]))
