"""Which autoscaler a GemmaRustServer gets, decided in one place (pure): `choose(spec, available) -> Autoscaling`.

KServe picks an InferenceService's autoscaler in one switch on its autoscaler class (kserve/kserve
pkg/controller/v1beta1/inferenceservice/reconcilers/autoscaler/autoscaler_reconciler.go, `createAutoscaler`: the
HPA reconciler or the KEDA one). `choose` is that switch here, over the spec and the optional apiVersions the
cluster serves (handlers discover them; builders.optional lists them). Its answer is all that the rest of the
operator knows about scaling: which kinds to build and which rival to delete (builders.children), the fewest
replicas (the Deployment, the PodDisruptionBudget, the autoscalers' own objects), what scales the server (the
ScaledObject's triggers, the endpoint picker's flow control), the warning when scale to zero cannot be had, and the
summary that the ScalingActive condition shows. Nothing else decides, and the user's spec is never rewritten.

The switch:
- no spec.autoscaling: no autoscaler; the objects of an earlier spec are deleted;
- minReplicas 0 where the KEDA HTTP add-on is served: KEDA's ScaledObject and the add-on's HTTPScaledObject, woken
  by the requests the add-on's interceptor holds and, behind an InferencePool, by the endpoint picker's queue
  (builders.autoscaling). The CRD refuses provider HPA with minReplicas 0: an HPA never goes below one replica;
- minReplicas 0 where the add-on is not served: held at one replica (nothing would hold or count the requests sent
  at zero), with a ScaleToZeroUnavailable warning, and then as for minReplicas 1, provider HPA where KEDA has no
  Prometheus to query;
- provider KEDA: a ScaledObject on the Prometheus query (reported as skipped where KEDA's CRD is missing: the
  user asked for KEDA, so there is no stand-in);
- provider Auto: a ScaledObject where KEDA's CRD is served and prometheus.serverAddress is set, else an HPA;
- provider HPA: an autoscaling/v2 HorizontalPodAutoscaler on a Pods metric.
A ScaledObject and an HPA both drive the replicas, so the one not chosen is deleted on every sync while the chosen
one is served (`replaces`), not only when the spec changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec import AUTOSCALING_METRICS, GemmaRustServerSpec
from .autoscaling import METRIC, PICKER_QUEUE, REQUESTS
from .optional import OPTIONAL_BY_KIND, OPTIONAL_KINDS

SCALED_OBJECT, HTTP_SCALED_OBJECT, HPA = "ScaledObject", "HTTPScaledObject", "HorizontalPodAutoscaler"
# The two kinds that drive the replicas: whichever is built, the other goes.
_RIVAL = {SCALED_OBJECT: HPA, HPA: SCALED_OBJECT}


@dataclass(frozen=True)
class Autoscaling:
    """The autoscaler chosen for one server (`choose`); the default is no autoscaler.

    kinds: the optional kinds asked for, driver first: each is built where the cluster serves it and reported
        skipped where it does not (choose already fell back where there is a stand-in).
    replaces: kinds deleted on every sync, since the chosen driver is built and they would drive the replicas too.
    floor, ceiling: the fewest and most replicas (spec.autoscaling.minReplicas, or 1 while held at one; its
        maxReplicas); None without an autoscaler.
    triggers: what scales the server, in the ScaledObject's order, among builders.autoscaling's METRIC, REQUESTS
        and PICKER_QUEUE.
    warning: (reason, message) of the Warning condition, when the spec asks for what the cluster cannot give.
    summary: the replicas and triggers as the ScalingActive condition says them, e.g.
        "1..4 replicas, gemma_num_requests_waiting 4 per pod".
    """

    kinds: tuple[str, ...] = ()
    replaces: tuple[str, ...] = ()
    floor: int | None = None
    ceiling: int | None = None
    triggers: tuple[str, ...] = ()
    warning: tuple[str, str] | None = None
    summary: str = ""

    @property
    def scales_to_zero(self) -> bool:
        """The autoscaler takes the server to zero replicas (and KEDA, the HTTP add-on and the picker wake it)."""
        return self.floor == 0

    def replicas(self, asked: int) -> int:
        """The Deployment's replicas for spec.replicas `asked`: clamped into floor..ceiling, as the autoscaler
        itself would, so the Deployment never leaves that range before the autoscaler's first act."""
        if self.floor is None or self.ceiling is None:
            return asked
        return min(max(asked, self.floor), self.ceiling)


def _served(kind: str, available: frozenset[str]) -> bool:
    return OPTIONAL_BY_KIND[kind].api_version in available


def _held_at_one_warning() -> tuple[str, str]:
    return ("ScaleToZeroUnavailable", "spec.autoscaling.minReplicas 0 needs the KEDA HTTP add-on to hold and count "
            "the requests sent at zero: " + OPTIONAL_BY_KIND[HTTP_SCALED_OBJECT].missing()
            + "; until it is, the server keeps at least 1 replica")


def choose(spec: GemmaRustServerSpec, available: frozenset[str]) -> Autoscaling:
    """The autoscaler for `spec` on a cluster that serves `available` (pure): the one switch (module docstring).

    Args:
        spec: the typed spec (with the operator's defaults, handlers.with_defaults).
        available: the optional apiVersions the cluster serves (builders.optional.OPTIONAL_KINDS), e.g.
            "keda.sh/v1alpha1".
    Returns:
        Autoscaling: the kinds, the rival to delete, the replica bounds, the triggers, the warning and the summary.
    """
    scaling = spec.autoscaling
    if scaling is None:
        return Autoscaling()
    prometheus = scaling.prometheus.server_address is not None
    floor, provider, warning = scaling.min_replicas, scaling.provider, None
    if floor == 0 and not _served(HTTP_SCALED_OBJECT, available):
        floor, warning = 1, _held_at_one_warning()
        provider = provider if prometheus else "HPA"  # KEDA has no Prometheus to query: the Pods metric
    if floor == 0:
        kinds = (SCALED_OBJECT, HTTP_SCALED_OBJECT)
        queue = prometheus and spec.gateway.inference_pool
        triggers = ((METRIC,) if prometheus else ()) + (REQUESTS,) + ((PICKER_QUEUE,) if queue else ())
    elif provider == "KEDA" or (provider == "Auto" and prometheus and _served(SCALED_OBJECT, available)):
        # Without an address KEDA has no gauge to query; the CRD refuses that spec (spec.AutoscalingSpec's rules).
        kinds, triggers = (SCALED_OBJECT,), (METRIC,) if prometheus else ()
    else:
        kinds, triggers = (HPA,), (METRIC,)
    replaces = (_RIVAL[kinds[0]],) if _served(kinds[0], available) else ()
    return Autoscaling(kinds, replaces, floor, scaling.max_replicas, triggers, warning,
                       _summary(spec, floor, triggers))


SERVES_EVERY_KIND = frozenset(row.api_version for row in OPTIONAL_KINDS)


def chosen_where_all_served(spec: GemmaRustServerSpec) -> Autoscaling:
    """The autoscaler `spec` gets on a cluster that serves every optional kind: what the Deployment's, the
    PodDisruptionBudget's and the endpoint picker's builders read when their caller passes no choice of its own
    (builders.children always passes the one made for the cluster)."""
    return choose(spec, SERVES_EVERY_KIND)


def _summary(spec: GemmaRustServerSpec, floor: int, triggers: tuple[str, ...]) -> str:
    scaling = spec.autoscaling
    said = {
        METRIC: f"{AUTOSCALING_METRICS[scaling.metric]} {scaling.target:g} per pod",
        REQUESTS: f"requests in flight at the KEDA HTTP add-on {spec.engine.max_num_seqs} per pod, to zero after "
                  f"{scaling.idle_seconds}s idle",
        PICKER_QUEUE: "requests queued at the endpoint picker, 1 wakes it",
    }
    return f"{floor}..{scaling.max_replicas} replicas, " + ", ".join(said[t] for t in triggers)
