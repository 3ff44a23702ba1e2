"""``enforce_eager=False`` on a CPU: decode steps on weights packed once for oneDNN give
the eager engine's greedy tokens (transformers' are checked in test_checkpoints.py), and
packing replaces the dense weights, and the start-up choice follows what it measured."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from safetensors.torch import load_file

from test_compiled_step import ENGINE, workload
from tinyserve import LLM, SamplingParams, packed_gemm
from tinyserve.checkpoint import save_pretrained
from tinyserve.compiled_step import capture_sizes_for
from tinyserve.executor import ModelExecutor
from tinyserve.model import get_preset, LlamaForServing

pytestmark = pytest.mark.skipif(not packed_gemm.onednn_available(),
                                reason="this torch has no oneDNN")


def test_packed_greedy_tokens_equal_eager_under_batching_chunking_caching_preemption():
    packed, eager = LLM(**ENGINE, enforce_eager=False), LLM(**ENGINE, enforce_eager=True)
    prompts, params = workload(seed=1)
    expected = eager.generate(prompts, params)
    got = packed.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    executor = packed.engine.executor
    assert executor.packed is not None and executor.graphs is None and not executor.enforce_eager
    assert executor.packed.steps_run > 0
    assert sum(o.request.num_preemptions for o in got) > 0
    assert packed.engine.block_manager.num_hit_tokens > 0
    assert packed.engine.block_manager.num_free_blocks == ENGINE["num_kv_blocks"]


class FakeClock:
    """``time.perf_counter`` for the start-up timing: a decoder layer takes 1 ms, or 10 ms
    on the side made slow (eager, with no packed layer, or packed); anything else, 1 ns
    between two readings (GEMMs timed padded and not: a tie, no padding)."""

    def __init__(self, slow: str, rows: tuple[int, ...] | None = None):
        self.now, self.slow = 0.0, slow
        self.rows = rows            # where that side is slow (None: all; elsewhere the other)

    def __call__(self) -> float:
        self.now += 1e-9
        return self.now

    def hook(self, module, args, kwargs):
        packed = args[7] if len(args) > 7 else kwargs.get("packed")
        slow = self.slow == "eager"
        if self.rows is not None and args[0].shape[0] not in self.rows:
            slow = not slow
        self.now += 0.010 if (packed is None) == slow else 0.001


@pytest.mark.parametrize("slow, kept", [("eager", True), ("packed", False)])
def test_the_choice_follows_the_measured_side(slow, kept, monkeypatch):
    """The timed steps at start decide: with eager measured clearly slower every bucket
    chooses packed and the packed weights are kept; with packed measured slower every
    bucket chooses eager and packing is dropped (dense weights, nothing packed)."""
    model = LlamaForServing.from_seed(get_preset("tiny"))
    clock = FakeClock(slow)
    handles = [layer.register_forward_pre_hook(clock.hook, with_kwargs=True) for layer in model.model.layers]
    monkeypatch.setattr(time, "perf_counter", clock)
    executor = ModelExecutor(model, num_blocks=16, block_size=4, enforce_eager=None,
                             capture_sizes=(1, 2, 4))
    monkeypatch.undo()
    for handle in handles:
        handle.remove()
    path = executor.packed
    want = "packed" if kept else "eager"
    assert path.choices == {1: want, 2: want, 4: want, 8: want}
    assert all(r == pytest.approx(10.0 if kept else 0.1) for r in path.speedups.values())
    assert (path.weights is not None) == kept and executor.enforce_eager == (not kept)
    dense = {n: p.device.type for n, p in model.named_parameters()}
    assert all(d == "cpu" for d in dense.values()) == (not kept)
    assert (("kept" if kept else "dropped") in path.describe())
    # Each bucket's line shows the spread of its pairs, not only their median.
    r = "10.00x (pairs 10.00-10.00, n=9)" if kept else "0.10x (pairs 0.10-0.10, n=9)"
    assert f"B=2: {want} ({r})" in path.describe()
    assert (path.padding is not None) == kept
    if kept:
        assert "not padded" in path.describe() and path.weights.pad_to == 1
        assert all(m.pad_to == 1 for m in path.weights._all())


@pytest.mark.parametrize("max_num_seqs", [1, 4, 16])
def test_the_choice_is_the_models_not_the_engines_seat_count(max_num_seqs, monkeypatch):
    """Every engine times the same batch sizes at start, whatever its own buckets, so
    engines on one model choose alike: here packed is faster only at 4 rows (as on a CPU
    whose 1-row steps favour eager), and a one-seat engine packs as a 16-seat one does."""
    model = LlamaForServing.from_seed(get_preset("tiny"))
    clock = FakeClock("eager", rows=(4,))
    handles = [layer.register_forward_pre_hook(clock.hook, with_kwargs=True) for layer in model.model.layers]
    monkeypatch.setattr(time, "perf_counter", clock)
    executor = ModelExecutor(model, num_blocks=16, block_size=4, enforce_eager=None,
                             capture_sizes=capture_sizes_for(max_num_seqs))
    monkeypatch.undo()
    for handle in handles:
        handle.remove()
    path = executor.packed
    assert tuple(path.timings) == packed_gemm.CHOICE_SIZES
    assert path.choices == {1: "eager", 2: "eager", 4: "packed", 8: "eager"}
    assert path.weights is not None and not executor.enforce_eager


def test_one_row_gemms_are_padded_where_padding_measured_faster(monkeypatch):
    # A clock under which a packed GEMM of one row takes 3 ms unpadded and 1 ms padded.
    model = LlamaForServing.from_seed(get_preset("tiny"))
    weights = packed_gemm.PackedWeights(model)
    for m in weights._all():
        m.pad_to = 1                        # the measurement, not the default, must pad them
    clock = [0.0]
    real = packed_gemm.onednn_matmul

    def timed_matmul(x, weight, bias):
        clock[0] += 0.001 if x.shape[0] >= packed_gemm.MIN_ROWS else 0.003
        return real(x, weight, bias)

    monkeypatch.setattr(packed_gemm, "onednn_matmul", timed_matmul)
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    ratio = weights.choose_padding()
    monkeypatch.undo()
    assert ratio.median == pytest.approx(3.0)
    assert weights.pad_to == packed_gemm.MIN_ROWS
    assert all(m.pad_to == packed_gemm.MIN_ROWS for m in weights._all())
    x = torch.randn(1, model.config.hidden_size)
    torch.testing.assert_close(weights.layers[0].o_proj(x), model.model.layers[0].self_attn.o_proj(x),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("slow", ["eager", "packed"])
def test_choosing_packs_the_first_layers_in_place_and_times_the_next_ones_dense(slow, monkeypatch):
    # The model is never held dense and packed at once: while the buckets are timed, the
    # first layers (twice the last-level cache) are packed in place and the next as many
    # run dense. Whichever side wins, every weight ends in exactly one form.
    model = LlamaForServing.from_seed(dataclasses.replace(get_preset("tiny"), num_hidden_layers=5))
    layers = model.config.num_hidden_layers
    dense = {n: p.clone() for n, p in model.named_parameters()}
    per_layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    monkeypatch.setattr(packed_gemm, "l3_cache_bytes", lambda: int(per_layer * 0.75))   # 2 layers
    clock = FakeClock(slow)
    timed, forms = [], []
    real_ratio = packed_gemm.paired_ratio

    def ratio(eager, packed, **k):
        forms.append([layer.mlp.down_proj.weight.device.type for layer in model.model.layers])
        handles = [layer.register_forward_pre_hook(
            lambda module, args, kwargs, i=i: timed.append(i) or clock.hook(module, args, kwargs),
            with_kwargs=True) for i, layer in enumerate(model.model.layers)]
        monkeypatch.setattr(time, "perf_counter", clock)
        try:
            return real_ratio(eager, packed, **k)
        finally:
            monkeypatch.setattr(time, "perf_counter", real_perf_counter)
            for handle in handles:
                handle.remove()

    real_perf_counter = time.perf_counter
    monkeypatch.setattr(packed_gemm, "paired_ratio", ratio)
    executor = ModelExecutor(model, num_blocks=16, block_size=4, enforce_eager=None,
                             capture_sizes=(1, 2))
    path = executor.packed
    # Four batch sizes timed (then, if packed is kept, the padding: every layer packed by then).
    sizes = len(packed_gemm.CHOICE_SIZES)
    assert forms[:sizes] == [["meta", "meta", "cpu", "cpu", "cpu"]] * sizes and set(timed) == {0, 1, 2, 3}
    assert path.layers_timed == 2 and f"layers 1-2 packed against 3-4 dense (of {layers})" in path.describe()
    if slow == "eager":         # packed kept: the probe's layers are the packed weights' own
        assert path.weights is not None and all(p.is_meta for n, p in model.named_parameters()
                                                if "layers." in n and "norm" not in n)
    else:                       # dense again, the very same numbers
        assert path.weights is None
        for name, p in model.named_parameters():
            assert torch.equal(p, dense[name]), name


def test_a_one_layer_model_times_a_packed_copy_and_still_ends_with_one_form():
    # Nothing to time its layer against but the layer itself: a copy, dropped after.
    model = LlamaForServing.from_seed(dataclasses.replace(get_preset("tiny"), num_hidden_layers=1))
    executor = ModelExecutor(model, num_blocks=16, block_size=4, enforce_eager=None,
                             capture_sizes=(1, 2))
    path = executor.packed
    assert "a packed copy of layer 1 against itself (of 1)" in path.describe()
    packed = path.weights is not None
    assert all(p.is_meta == packed for n, p in model.named_parameters() if n.endswith("proj.weight")
               and "lm_head" not in n)


def linear_bytes_held(llm) -> int:
    """Bytes of weight storage the engine holds: dense parameters (each storage once)
    and the packed copies."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in llm.model.parameters() if not p.is_meta}
    path = llm.engine.executor.packed
    held = [] if path is None or path.weights is None else path.weights._all()
    packed = sum(w.numel() * w.element_size() for m in held
                 for w in (m.dense_weight() if path.weights.form == "upcast" else m.packed, m.bias)
                 if w is not None)
    return sum(storages.values()) + packed


@pytest.mark.parametrize("tied", [False, True])
def test_packing_replaces_the_weights_instead_of_copying_them(tied, tmp_path):
    config = dataclasses.replace(get_preset("tiny"), tie_word_embeddings=tied)
    save_pretrained(LlamaForServing.from_seed(config, seed=3), tmp_path)
    checkpoint = sum(t.numel() * t.element_size() for t in load_file(tmp_path / "model.safetensors").values())
    llm = LLM(str(tmp_path), **{k: v for k, v in ENGINE.items() if k != "model"}, enforce_eager=False)
    assert llm.engine.executor.packed.weights is not None
    assert linear_bytes_held(llm) == checkpoint
    eager = LLM(str(tmp_path), **{k: v for k, v in ENGINE.items() if k != "model"}, enforce_eager=True)
    assert linear_bytes_held(eager) == checkpoint
    # Saving unpacks for the moment it takes: the file is the checkpoint, byte for byte.
    llm.save_pretrained(tmp_path / "again")
    again = load_file(tmp_path / "again" / "model.safetensors")
    for name, t in load_file(tmp_path / "model.safetensors").items():
        assert torch.equal(again[name], t), name
    assert linear_bytes_held(llm) == checkpoint


@pytest.mark.parametrize("rows", [1, 2, 5])     # 1 and 2 are padded to MIN_ROWS inside, or not
@pytest.mark.parametrize("pad_to", [1, packed_gemm.MIN_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_layers_compute_what_the_linear_layers_compute(bias, pad_to, rows):
    config = dataclasses.replace(get_preset("tiny"), qkv_bias=bias, mlp_bias=bias, o_bias=bias)
    model = LlamaForServing.from_seed(config, seed=2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_()
    layer, packed = model.model.layers[0], packed_gemm.PackedWeights(model).layers[0]
    for merged in packed.merged:
        merged.pad_to = pad_to
    x = torch.randn(rows, config.hidden_size)
    attn, mlp = layer.self_attn, layer.mlp
    for got, linear in zip(packed.project_qkv(x), (attn.q_proj, attn.k_proj, attn.v_proj)):
        torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)
    for got, linear in zip(packed.project_gate_up(x), (mlp.gate_proj, mlp.up_proj)):
        torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)
    y = torch.randn(rows, config.intermediate_size)
    torch.testing.assert_close(packed.down_proj(y), mlp.down_proj(y), rtol=1e-5, atol=1e-5)
    # A padded GEMM keeps one buffer: the next call, inside inference mode or not, with
    # fewer rows than the last, still gets only its own rows' results.
    with torch.inference_mode():
        packed.down_proj(torch.randn(3, config.intermediate_size))
    y = y[:1]
    torch.testing.assert_close(packed.down_proj(y), mlp.down_proj(y), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("tied", [False, True])
def test_the_output_projection_computes_what_lm_head_computes(tied, rows):
    # Untied: a packed copy; tied: oneDNN on the embedding table itself.
    config = dataclasses.replace(get_preset("tiny"), tie_word_embeddings=tied)
    model = LlamaForServing.from_seed(config, seed=3)
    weights = packed_gemm.PackedWeights(model)
    assert (weights.head is None) == tied
    x = torch.randn(rows, config.hidden_size)
    torch.testing.assert_close(weights.lm_head(x), model.lm_head(x), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not packed_gemm.packs(torch.bfloat16),
                    reason="oneDNN packs no bf16 on this CPU: a bf16 model takes the upcast form")
@pytest.mark.parametrize("rows", [1, packed_gemm.TIED_KERNEL_ROWS, packed_gemm.TIED_KERNEL_ROWS + 1, 9])
def test_a_tied_bf16_head_of_few_rows_runs_in_our_kernel_and_of_more_in_onednn(rows, monkeypatch):
    config = dataclasses.replace(get_preset("tiny"), tie_word_embeddings=True)
    model = LlamaForServing.from_seed(config, seed=3).to(torch.bfloat16)
    weights = packed_gemm.PackedWeights(model)
    assert weights.form == "packed" and weights.head is None
    calls = []
    kernel = packed_gemm.bf16_gemm.matmul
    monkeypatch.setattr(packed_gemm.bf16_gemm, "matmul", lambda *a, **k: calls.append(a[1]) or kernel(*a, **k))
    table = model.model.embed_tokens.weight
    x = torch.randn(rows, config.hidden_size, dtype=torch.bfloat16)
    got = weights.lm_head(x)
    few = rows <= packed_gemm.TIED_KERNEL_ROWS and packed_gemm.bf16_gemm.available()
    assert [w is table for w in calls] == ([True] if few else [])      # the table as it lies
    assert got.dtype == torch.bfloat16 and got.shape == (rows, config.vocab_size)
    torch.testing.assert_close(got.float(), x.float() @ table.float().T, rtol=1.6e-2, atol=1e-2)


def test_a_dtype_is_packed_exactly_where_onednn_packs_it_and_bf16_upcast_elsewhere():
    model = LlamaForServing.from_seed(get_preset("tiny"))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        model = model.to(dtype)
        try:
            torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 4, dtype=dtype), 8)
            reorders = dtype != torch.float16
        except RuntimeError:
            reorders = False
        expected = "packed" if reorders else "upcast" if dtype == torch.bfloat16 else None
        assert packed_gemm.form(model) == expected, dtype
        assert packed_gemm.supported(model) == (expected is not None)


@pytest.fixture
def no_native_bf16(monkeypatch):
    """This CPU as one without native bf16, whatever it has: oneDNN packs fp32 only."""
    monkeypatch.setattr(packed_gemm, "packs", lambda dtype: dtype == torch.float32)


@pytest.mark.parametrize("rows", [1, 5, 6, 40, 80])   # the fused kernel; above MAX_ROWS: chunks
@pytest.mark.parametrize("bias", [False, True])
def test_upcast_layers_compute_what_the_linear_layers_compute(bias, rows, no_native_bf16, monkeypatch):
    # A scratch buffer of 3 rows of the widest weight: every GEMM of many rows runs in chunks.
    config = dataclasses.replace(get_preset("tiny"), qkv_bias=bias, mlp_bias=bias, o_bias=bias,
                                 tie_word_embeddings=True)
    monkeypatch.setattr(packed_gemm, "UPCAST_SCRATCH_BYTES", 3 * 4 * config.intermediate_size)
    model = LlamaForServing.from_seed(config, seed=2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_()
    model = model.to(torch.bfloat16)
    weights = packed_gemm.PackedWeights(model)
    assert weights.form == "upcast" and weights.scratch.dtype == torch.float32
    layer, upcast = model.model.layers[0], weights.layers[0]
    x = torch.randn(rows, config.hidden_size, dtype=torch.bfloat16)
    y = torch.randn(rows, config.intermediate_size, dtype=torch.bfloat16)
    attn, mlp = layer.self_attn, layer.mlp
    # Against the same bf16 weights in fp32, rounded to bf16 once at the end: both ways agree
    # with it to bf16's precision (one rounding of the output, or bf16 F.linear's own).
    pairs = [*zip(upcast.project_qkv(x), (attn.q_proj, attn.k_proj, attn.v_proj)),
             *zip(upcast.project_gate_up(x), (mlp.gate_proj, mlp.up_proj)),
             (upcast.down_proj(y), mlp.down_proj), (upcast.o_proj(x), attn.o_proj)]
    for got, linear in pairs:
        source = y if linear is mlp.down_proj else x
        want = torch.nn.functional.linear(source.float(), linear.weight.float(),
                                          None if linear.bias is None else linear.bias.float())
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=1e-2)
    # The tied head multiplies the embedding table itself, in chunks too.
    want = x.float() @ model.model.embed_tokens.weight.float().T
    torch.testing.assert_close(weights.lm_head(x).float(), want, rtol=1.6e-2, atol=1e-2)


def test_bf16_without_native_bf16_serves_on_its_own_weights_once(no_native_bf16, tmp_path):
    # enforce_eager=None takes the upcast form without timing, whatever the cache holds; the
    # weights are the checkpoint's bytes, once; every request finishes and every block is back.
    config = dataclasses.replace(get_preset("tiny"), tie_word_embeddings=True)
    save_pretrained(LlamaForServing.from_seed(config, seed=3).to(torch.bfloat16), tmp_path)
    checkpoint = sum(t.numel() * t.element_size() for t in load_file(tmp_path / "model.safetensors").values())
    llm = LLM(str(tmp_path), **{k: v for k, v in ENGINE.items() if k != "model"}, dtype="bfloat16")
    path = llm.engine.executor.packed
    assert path.weights.form == "upcast" and path.choices == {} and "without native bf16" in path.describe()
    assert linear_bytes_held(llm) == checkpoint
    prompts, params = workload(seed=1)
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
    assert path.steps_run > 0
    assert llm.engine.block_manager.num_free_blocks == ENGINE["num_kv_blocks"]


def test_the_default_times_packing_wherever_onednn_packs_the_dtype(monkeypatch):
    # In the last-level cache too: eager GEMMs re-lay their weights out on every call.
    from tinyserve import engine, host
    model = LlamaForServing.from_seed(get_preset("tiny"))
    size = packed_gemm.weight_bytes(model)
    for cache in (size - 1, size, 100 * size):
        monkeypatch.setattr(host, "l3_cache_bytes", lambda: cache)
        assert engine.default_enforce_eager(model) is None        # measure at start
    assert engine.default_enforce_eager(model.to(torch.float16)) is True  # not packed
    monkeypatch.setattr(packed_gemm, "packs", lambda dtype: dtype == torch.float32)
    assert engine.default_enforce_eager(model.to(torch.bfloat16)) is None  # upcast


def test_weight_bytes_count_a_tied_output_projection_once():
    model = LlamaForServing.from_seed(get_preset("tiny"))
    assert model.config.tie_word_embeddings is False
    untied = packed_gemm.weight_bytes(model)
    expected = sum(p.numel() * 4 for n, p in model.named_parameters() if "embed_tokens" not in n)
    assert untied == expected
    tied = LlamaForServing.from_seed(dataclasses.replace(get_preset("tiny"), tie_word_embeddings=True))
    assert packed_gemm.weight_bytes(tied) == expected      # the table, read once, as lm_head
