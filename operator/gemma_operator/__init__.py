"""Kubernetes operator for GemmaRustServer (API group gemmarust.dev, v1alpha1).

Modules, in the order data flows: spec (pydantic spec, source of the CRD) -> crd (CRD generator) ->
builders (pure: spec -> child objects) -> kube (API edge) -> engine (polls pods' /v1/engine, /v1/models)
-> status (pure: observation -> status, conditions, events) -> handlers (kopf wiring).
"""
