"""The table of optional kinds (gemma_operator/builders/optional.py): golden dicts, no cluster involved."""

from __future__ import annotations

from gemma_operator.builders.optional import OPTIONAL_KINDS

from .specs import META, autoscaler_for, tpu_spec


def test_every_optional_row_names_its_crd_and_a_builder_of_its_own_kind():
    spec = tpu_spec(autoscaling={"maxReplicas": 4, "target": 4, "prometheus": {"serverAddress": "http://p:9090"}},
                    monitoring={"serviceMonitor": True},
                    gateway={"inferencePool": True, "endpointPicker": {"name": "e"}})
    for row in OPTIONAL_KINDS:
        obj = row.build(spec, META, autoscaler_for(spec))
        assert (obj["apiVersion"], obj["kind"]) == (row.api_version, row.kind)
        assert row.crd is None or row.crd == f"{row.plural}.{row.api_version.split('/')[0]}"
