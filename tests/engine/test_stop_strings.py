"""Stopping on text (`SamplingParams.stop_strings`, `agentrl/engine/stop_strings.py`): the end of a tool call
stops a request however its text was split into tokens, which a stop sequence of ids does not."""

import pytest

from agentrl.engine import Engine, EngineConfig, SamplingParams
from agentrl.engine.stop_strings import StopStrings
from agentrl.models import load_model
from agentrl.tokenizer import byte_tokenizer
from tests.helpers import hf_greedy, random_prompts


def merging_tokenizer():
    """The offline byte tokenizer with one merge more: a newline followed by `</` is one token, as in real BPE
    vocabularies (`Ċ</` in byte-level notation)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for tok, i in byte_tokenizer().get_vocab().items() if i < 256}  # the bytes only
    vocab["Ċ<"], vocab["Ċ</"] = 256, 257
    core = Tokenizer(models.BPE(vocab=vocab, merges=[("Ċ", "<"), ("Ċ<", "/")], unk_token=None, fuse_unk=False))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core)


def test_a_tag_written_in_other_pieces_stops_on_text_but_not_on_its_ids():
    tok = merging_tokenizer()
    tag = "</tool_call>"
    as_ids = tok.encode(tag, add_special_tokens=False)  # the pieces a stop sequence would look for
    generated = tok.encode('{"name": "search"}\n</tool_call>', add_special_tokens=False)
    assert tok.convert_tokens_to_ids("Ċ</") in generated  # the model wrote "\n</" as one token ...
    assert not any(generated[i:i + len(as_ids)] == as_ids for i in range(len(generated)))  # ... so no id match
    stops = StopStrings(tok)
    hits = [i for i in range(len(generated)) if stops.hit(generated, 0, i, (tag,))]
    assert hits == [len(generated) - 1]  # on the token that completes the tag, and nowhere before
    assert not stops.hit(generated, len(generated) - 2, len(generated) - 1, (tag,))  # not before `start`
    assert stops.tokens_holding(">") == {i for i in range(len(tok)) if ">" in tok.decode([i])}


def test_the_engine_stops_a_request_once_its_text_holds_a_stop_string():
    model, _ = load_model("tiny-qwen3")
    tok = byte_tokenizer()
    prompt = random_prompts(1, 20, 21, seed=3)[0]
    ref = hf_greedy(model, prompt, 24)
    cut = next(i for i in range(4, len(ref)) if all(t < 256 for t in ref[i - 2:i + 1]))  # three byte tokens
    text = tok.decode(ref[cut - 2:cut + 1])
    first = next(i for i in range(len(ref)) if text in tok.decode(ref[:i + 1]))  # where the text first appears
    engine = Engine(model, EngineConfig(num_pages=16, max_model_len=64), tokenizer=tok)
    assert engine.stops_on_text
    out = engine.generate([prompt], SamplingParams(max_new_tokens=24, temperature=0, stop_strings=(text,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[:first + 1]
    with pytest.raises(ValueError, match="stop_strings need the engine's tokenizer"):
        Engine(model, EngineConfig(num_pages=16, max_model_len=64)).submit(
            prompt, SamplingParams(stop_strings=("x",)))
    with pytest.raises(ValueError, match="empty"):
        SamplingParams(stop_strings=("",))


def test_the_driver_stops_a_turn_after_its_call_by_ids_and_by_text_where_the_engine_decodes():
    from types import SimpleNamespace

    from agentrl.rollout.driver import tool_call_stops

    fmt = SimpleNamespace(stop_sequences=[[1, 2, 3]], stop_strings=["</tool_call>"])
    decoding, plain = SimpleNamespace(stops_on_text=True), SimpleNamespace()
    assert tool_call_stops(fmt, decoding, True) == {"stop_sequences": ((1, 2, 3),), "stop_strings": ("</tool_call>",)}
    assert tool_call_stops(fmt, plain, True) == {"stop_sequences": ((1, 2, 3),), "stop_strings": ()}
    assert tool_call_stops(fmt, decoding, False) == {}
