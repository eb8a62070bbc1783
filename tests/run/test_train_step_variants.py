"""`benchmarks/train_step.py`'s variant names: what each sets on top of the defaults, refused before any GPU time."""

import re

import pytest

from benchmarks.train_step import default_overrides, parse_variant


def test_default_variants_set_run_options_on_top_of_the_defaults():
    assert default_overrides("default") == []
    assert default_overrides("default-eager") == ["--trainer.cuda_graphs=false"]
    assert default_overrides("default+trainer.rows_per_micro_batch=2+model.activation_memory_budget=0.6") == [
        "--trainer.rows_per_micro_batch=2", "--model.activation_memory_budget=0.6"]
    assert default_overrides("nockpt+compile+varlen") is None
    assert parse_variant("default+trainer.rows_per_micro_batch=2") == ("default+trainer.rows_per_micro_batch=2", None)
    assert parse_variant("nockpt+compile+mem0.6+varlen@2") == ("nockpt+compile+mem0.6+varlen", 2)


@pytest.mark.parametrize("variant,message", [
    ("default+trainer.no_such_knob=2", "unknown key 'trainer.no_such_knob'"),
    ("default+trainer.rows_per_micro_batch=two", "expected an integer"),
    ("default+trainer.rows_per_micro_batch", "expected default+key=value"),
    ("nockpt+mem0.5", "expected default or"),
])
def test_a_bad_variant_is_refused_with_what_is_wrong(variant, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        parse_variant(variant)
