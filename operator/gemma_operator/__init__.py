"""Kubernetes operator for GemmaRustServer (API group gemmarust.dev, v1alpha1).

Modules, in the order data flows: spec (pydantic spec, source of the CRD) -> crd (CRD generator) ->
admission (who may set pod-level fields: the admission policy generator, the operator's allowlists) ->
builders (pure: spec -> child objects) -> kube (API edge) -> poller (polls pods' /v1/engine) ->
redact (pure: pod-written text) -> status (pure: observation -> status, conditions, events) -> handlers
(kopf wiring); settings holds the operator's environment settings.
"""
