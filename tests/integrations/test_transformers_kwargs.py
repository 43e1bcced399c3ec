"""Every keyword argument that the installed transformers' models pass to their attention
function is consumed by astrai's integration, refused where set, or listed as carrying no
meaning for attention (``astrai.integrations.transformers``: CONSUMED_KWARGS, REFUSED_KWARGS,
NO_MEANING_FOR_ATTENTION); any other raises NotImplementedError at run time. So a new
transformers release cannot bring a keyword that astrai would silently ignore: this walk of
every ``modeling_*.py`` fails first.

How transformers calls an attention function: a model's attention module looks its function up
in ``ALL_ATTENTION_FUNCTIONS`` (``attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
self.config._attn_implementation, eager_attention_forward)``) and calls it with q, k, v, the
mask, keywords of its own (``scaling=``, ``sliding_window=``, ``indices=``, ...) and the
``**kwargs`` that flowed down from the model's forward: ``Unpack[TransformersKwargs]`` or
``Unpack[FlashAttentionKwargs]`` (typed dicts whose keys are known), or untyped ones carrying
the same, and continuous batching's ``PagedAttentionArgs``.
"""

from __future__ import annotations

import ast
import functools
import inspect
import pathlib

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from transformers.generation.continuous_batching.input_outputs import (  # noqa: E402
    PagedAttentionArgs,
)
from transformers.modeling_flash_attention_utils import FlashAttentionKwargs  # noqa: E402
from transformers.utils.generic import TransformersKwargs  # noqa: E402

import astrai.integrations.transformers as astrai_transformers  # noqa: E402

MODELS = pathlib.Path(transformers.__file__).parent / "models"
TYPED_KWARGS = {
    "TransformersKwargs": set(TransformersKwargs.__annotations__),
    "FlashAttentionKwargs": set(FlashAttentionKwargs.__annotations__),
}
# Continuous batching passes these to the model's forward, which hands them down; input_ids is
# the embedding's.
CONTINUOUS_BATCHING_KWARGS = set(PagedAttentionArgs.__annotations__) - {"input_ids"}
POSITIONAL = [
    name
    for name in inspect.signature(astrai_transformers.attention_forward).parameters
    if name != "kwargs"
][:5]  # module, query, key, value, attention_mask


def attention_call_keywords(source: str, where: str) -> dict:
    """{keyword: where} for the calls of an attention function in one modeling file: the
    explicit keywords, and the keys that each ``**splat`` carries."""
    tree = ast.parse(source)
    # Names bound to an attention function: assigned from an expression naming
    # ALL_ATTENTION_FUNCTIONS.
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            if "ALL_ATTENTION_FUNCTIONS" in ast.unparse(node.value):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, (ast.Name, ast.Attribute)):
                        bound.add(target.id if isinstance(target, ast.Name) else target.attr)
    typed_dicts = local_typed_dicts(tree)
    enclosing = {}  # node -> the function it is in
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                enclosing[node] = function  # inner functions overwrite: walked later
    found = {}
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and calls_attention(call, bound)):
            continue
        for keyword in call.keywords:
            if keyword.arg is not None:
                found.setdefault(keyword.arg, where)
                continue
            function = enclosing.get(call)
            for name in splat_keys(keyword.value, function, typed_dicts, where):
                found.setdefault(name, where)
    return found


def calls_attention(call: ast.Call, bound: set) -> bool:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id in bound
    if isinstance(func, ast.Attribute):
        return func.attr in bound
    return "ALL_ATTENTION_FUNCTIONS" in ast.unparse(func)  # ALL_ATTENTION_FUNCTIONS[...](...)


def local_typed_dicts(tree: ast.Module) -> dict:
    """{class name: its keys} of the TypedDicts a modeling file defines (model-specific kwargs)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(b) for b in node.bases]
            keys = {
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
            for base in bases:
                keys |= TYPED_KWARGS.get(base, set()) | found.get(base, set())
            if any(b in TYPED_KWARGS or b in found or "TypedDict" in b for b in bases):
                found[node.name] = keys
    return found


def splat_keys(value: ast.expr, function, typed_dicts: dict, where: str) -> set:
    """The keys a ``**value`` in a call can carry."""
    if not isinstance(value, ast.Name):
        raise AssertionError(f"{where}: cannot tell what **{ast.unparse(value)} carries")
    kwarg = function.args.kwarg
    if kwarg is not None and kwarg.arg == value.id:
        annotation = kwarg.annotation
        if annotation is None:  # untyped: the model forward's TransformersKwargs
            return TYPED_KWARGS["TransformersKwargs"]
        text = ast.unparse(annotation)
        name = text.removeprefix("Unpack[").removesuffix("]")
        if name in TYPED_KWARGS:
            return TYPED_KWARGS[name]
        if name in typed_dicts:
            return typed_dicts[name]
        raise AssertionError(f"{where}: **{value.id}: {text} is not a known typed dict")
    # A local dict: its literal keys (e.g. radio's attention_kwargs = {"dropout": ..., ...}).
    for node in ast.walk(function):
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == value.id for t in node.targets)
            and isinstance(node.value, ast.Dict)
            and all(isinstance(k, ast.Constant) for k in node.value.keys)
        ):
            return {k.value for k in node.value.keys}
    raise AssertionError(f"{where}: cannot tell what **{value.id} carries")


@functools.cache
def keywords_by_model() -> dict:
    """{model: its attention calls' keywords} over every modeling file of transformers."""
    found = {}
    for path in sorted(MODELS.glob("*/modeling_*.py")):
        source = path.read_text()
        if "ALL_ATTENTION_FUNCTIONS" in source:
            found[path.parent.name] = attention_call_keywords(source, path.parent.name)
    return found


def every_model_keyword() -> dict:
    """{keyword: one model that passes it}, over every model, plus what continuous batching
    hands down."""
    found = {}
    for keywords in keywords_by_model().values():
        for name, where in keywords.items():
            found.setdefault(name, where)
    for name in CONTINUOUS_BATCHING_KWARGS:
        found.setdefault(name, "continuous batching")
    return found


KNOWN = (
    set(astrai_transformers.CONSUMED_KWARGS)
    | set(astrai_transformers.REFUSED_KWARGS)
    | set(astrai_transformers.NO_MEANING_FOR_ATTENTION)
    | set(POSITIONAL)
)


def test_every_keyword_a_model_passes_is_consumed_refused_or_listed():
    found = every_model_keyword()
    unknown = {name: where for name, where in found.items() if name not in KNOWN}
    assert not unknown, (
        "transformers' models pass these keywords to the attention function, and "
        f"astrai.integrations.transformers neither consumes, refuses nor lists them: {unknown}"
    )


def test_the_walk_finds_what_it_must():
    """The walk is not vacuous: it sees the calls of hundreds of models, and the keywords the
    features ride on (a transformers change of dispatch would show here)."""
    models = [model for model, keywords in keywords_by_model().items() if keywords]
    assert len(models) > 300, len(models)
    found = every_model_keyword()
    for needed in ("scaling", "sliding_window", "softcap", "s_aux", "indices", "dropout"):
        assert needed in found, needed
    for model in ("llama", "gemma2", "gpt_oss", "deepseek_v32", "glm_moe_dsa", "gemma4"):
        assert model in models, model


def test_control_a_new_keyword_is_found():
    source = """
from ...modeling_utils import ALL_ATTENTION_FUNCTIONS
class Attention:
    def forward(self, hidden_states, mask, **kwargs: Unpack[TransformersKwargs]):
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface("x", eager_attention_forward)
        return attention_interface(self, q, k, v, mask, scaling=1.0, brand_new=True, **kwargs)
"""
    found = attention_call_keywords(source, "a future model")
    assert {"scaling", "brand_new", "position_ids", "cu_seq_lens_q"} <= set(found)
    assert "brand_new" not in KNOWN


def test_each_list_says_why():
    for name, why in {
        **astrai_transformers.REFUSED_KWARGS,
        **astrai_transformers.NO_MEANING_FOR_ATTENTION,
    }.items():
        assert isinstance(why, str) and len(why) > 20, name
    lists = (
        set(astrai_transformers.CONSUMED_KWARGS),
        set(astrai_transformers.REFUSED_KWARGS),
        set(astrai_transformers.NO_MEANING_FOR_ATTENTION),
    )
    assert not (lists[0] & lists[1] or lists[0] & lists[2] or lists[1] & lists[2])


# -- at run time ------------------------------------------------------------------------------


class FakeModule(torch.nn.Module):
    is_causal = True


def qkv(q_len=6):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, q_len, 8, generator=g)  # [B, H, L, D]: transformers' layout
    k = torch.randn(1, 2, q_len, 8, generator=g)
    v = torch.randn(1, 2, q_len, 8, generator=g)
    return q, k, v


def call(**kwargs):
    q, k, v = qkv()
    return astrai_transformers.attention_forward(FakeModule(), q, k, v, None, **kwargs)


def test_an_unknown_keyword_raises_naming_it():
    with pytest.raises(NotImplementedError, match="brand_new: transformers passed this keyword"):
        call(brand_new=1)


@pytest.mark.parametrize("name", sorted(astrai_transformers.REFUSED_KWARGS))
def test_a_refused_keyword_raises_when_set_and_passes_when_not(name):
    call(**{name: None})
    with pytest.raises(NotImplementedError, match=f"{name}: .* is not supported"):
        call(**{name: torch.zeros(1) if name != "deterministic" else True})


@pytest.mark.parametrize("name", sorted(astrai_transformers.NO_MEANING_FOR_ATTENTION))
def test_a_keyword_without_meaning_for_attention_changes_nothing(name):
    torch.testing.assert_close(call(**{name: torch.arange(6)[None]})[0], call()[0])


def test_output_attentions_raises_instead_of_returning_no_weights():
    call(output_attentions=False)
    with pytest.raises(NotImplementedError, match="output_attentions"):
        call(output_attentions=True)


def test_per_token_sinks_raise_and_per_head_sinks_are_taken():
    out, _ = call(sinks=torch.full((4,), 3.0))
    torch.testing.assert_close(out, call(s_aux=torch.full((4,), 3.0))[0])
    assert not torch.allclose(out, call()[0])
    with pytest.raises(NotImplementedError, match=r"sinks: astrai takes one sink logit per query"):
        call(sinks=torch.zeros(1, 4, 6, 1))


def test_packed_sequences_see_only_themselves():
    """cu_seq_lens_q/k (flash's varlen description of one row holding several sequences) in a
    dense call: each query attends within its own sequence, as if run alone."""
    q, k, v = qkv(q_len=7)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    packed, _ = astrai_transformers.attention_forward(
        FakeModule(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4
    )
    alone = [
        astrai_transformers.attention_forward(
            FakeModule(), q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], None
        )[0]
        for a, b in ((0, 3), (3, 7))
    ]
    torch.testing.assert_close(packed, torch.cat(alone, dim=1))
    # Control: without them the second sequence sees the first.
    unpacked, _ = astrai_transformers.attention_forward(FakeModule(), q, k, v, None)
    assert not torch.allclose(unpacked[:, 3:], alone[1])


def test_continuous_batching_indices_become_positions_within_each_sequence():
    """In a continuous-batching step transformers gathers a layer's keys sequence after sequence
    (cu_seq_lens_k) under a block-diagonal mask, so an index is a position along that axis. Here
    two sequences: 3 new tokens over 2 cached, and 2 over 2; each token lists 3 keys, some of the
    other sequence (masked there: unused here). Against the float64 reference of each sequence
    with its rows' own positions."""
    from tests.reference import sequence_reference

    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 4, 5, 8, generator=g, dtype=torch.float64)  # [1, Hq, T, D]
    k = torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64)  # gathered: 5 then 4 keys
    v = torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64)
    cu_q = torch.tensor([0, 3, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 9], dtype=torch.int32)
    indices = torch.tensor(
        [[[0, 2, 7], [1, 3, 4], [4, 0, 8], [5, 6, 1], [8, 7, 6]]], dtype=torch.int32
    )
    step = dict(
        cu_seq_lens_q=cu_q,
        cu_seq_lens_k=cu_k,
        max_length_q=3,
        max_length_k=5,
        read_index=[torch.arange(9)],
        write_index=[torch.arange(5)],
    )
    out, _ = astrai_transformers.attention_forward(
        FakeModule(), q, k, v, None, indices=indices, **step
    )
    within = [
        torch.tensor([[0, 2, -1], [1, 3, 4], [4, 0, -1]], dtype=torch.int32),
        torch.tensor([[0, 1, -1], [3, 2, 1]], dtype=torch.int32),
    ]
    expected = torch.cat(
        [
            sequence_reference(
                q[0, :, a:b].transpose(0, 1),
                k[0, :, c:d].transpose(0, 1),
                v[0, :, c:d].transpose(0, 1),
                is_causal=True,
                topk_indices=rows,
            )
            for (a, b, c, d), rows in zip(((0, 3, 0, 5), (3, 5, 5, 9)), within)
        ]
    )
    torch.testing.assert_close(out[0].double(), expected)
    # Control: the same step without the indices differs.
    dense, _ = astrai_transformers.attention_forward(FakeModule(), q, k, v, None, **step)
    assert not torch.allclose(dense[0].double(), expected, atol=1e-6)
