"""Kubernetes operator for GemmaRustServer (API group gemmarust.dev, v1alpha1).

Modules, in the order data flows: spec (pydantic spec, source of the CRD) -> crd (CRD generator) ->
admission (who may set pod-level fields: the admission policy generator, the operator's allowlists) ->
builders/ (pure: spec -> child objects, a module per child kind) -> kube (API edge) -> poller (polls pods'
/v1/engine) -> pods (pure: facts of one Pod) -> redact (pure: pod-written text) -> events (pure: why a pod
cannot start) -> status (pure: observation -> status, conditions, events) -> handlers (kopf wiring);
registry owns the operator's state (settings, clients, what is held per server); settings holds the
operator's environment settings.
"""
