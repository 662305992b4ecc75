"""`python -m gemma_operator`: the same as `kopf run --standalone --all-namespaces -m gemma_operator.handlers`.

Extra arguments go to `kopf run` (e.g. `--namespace team-a`, `--liveness=http://0.0.0.0:8080/healthz`,
`--verbose`). Without --namespace the operator serves all namespaces; with one or more (the chart's
watchNamespaces), only those.
"""

import sys

from kopf.cli import main


def kopf_argv(args: list[str]) -> list[str]:
    """The `kopf` command line for `python -m gemma_operator ARGS` (pure).

    --standalone: one operator, no peering objects (neither the RBAC rules nor the chart provide for them).
    """
    scope = [] if any(a.startswith(("--namespace", "-n", "--all-namespaces", "-A")) for a in args) else ["--all-namespaces"]
    return ["run", "--standalone", *scope, "-m", "gemma_operator.handlers", *args]


if __name__ == "__main__":
    sys.exit(main(kopf_argv(sys.argv[1:])))
