"""Our decoder and runner against transformers: logits, KV-cache bookkeeping, and the GGUF loader.

Metric throughout: relative error = max |ours - reference| / max |reference| over every logit compared.
float32 bound 1e-5 on tiny random models (the two implementations do the same float32 ops, in a
different order: fused q/k/v, masked SDPA over a padded cache), 1e-4 on SmolLM2 (30 layers deep).

Tiny models (tests/support/models.py) cover GQA and MHA, tied and untied embeddings, q/k/v biases (Qwen2),
q/k norm with head_dim != hidden / heads (Qwen3) and the linear, llama3 and yarn rope scalings. The
reference for a ragged batch, a tree append or a rollback is transformers run on each row's plain linear
sequence, unpadded.
"""

from __future__ import annotations

import copy
import errno
import os

import pytest
import torch

from rollout_ssd.models.config import rope_inv_freq
from rollout_ssd.models.decoder import rms_norm
from rollout_ssd.models.loader import build_decoder, load_pretrained
from rollout_ssd.runner import ModelRunner
from tests.support.hf_reference import hf_logits, rel_err
from tests.support.models import FAMILIES, build_tiny

TOL_F32 = 1e-5
TOL_F32_DEFAULT = 1e-4


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory):
    """(transformers model, our LoadedModel) for one tiny family, float32."""
    path = tmp_path_factory.mktemp(request.param)
    hf = build_tiny(path, request.param, seed=11)
    return hf, load_pretrained(str(path), dtype="float32")


def _random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _runner(loaded, num_slots: int = 4, max_len: int = 64) -> ModelRunner:
    return ModelRunner(loaded.model, num_slots=num_slots, max_len=max_len)


# ---- tiny random models ------------------------------------------------------------------------


def test_layer_outputs_are_hf_hidden_states_and_run_the_layers_asked(tiny):
    """Decoder.layer_outputs (forward_train's pass; bench probes read layers' states and leave layers out):
    the residual stream after layer i is transformers' hidden_states[i + 1] within TOL_F32, forward_train is
    its final norm; given a list it runs those layers in that order, as a model built of them alone does."""
    hf, ours = tiny
    model = ours.model
    tokens = torch.tensor([_random_ids(12, model.cfg.vocab_size, seed=3)])
    with torch.no_grad():
        states = list(model.layer_outputs(tokens))
        ref = hf(tokens, output_hidden_states=True).hidden_states
        assert [i for i, _ in states] == list(range(model.cfg.num_layers))
        for i, x in states[:-1]:  # HF's last entry is after the final norm
            assert rel_err(x, ref[i + 1]) < TOL_F32, i
        assert rel_err(model.forward_train(tokens), ref[-1]) < TOL_F32
        subset = [model.cfg.num_layers - 1, 0]
        ran = list(model.layer_outputs(tokens, subset))
        assert [i for i, _ in ran] == subset
        alone = copy.deepcopy(model)
        alone.layers = torch.nn.ModuleList(alone.layers[i] for i in subset)
        assert torch.equal(alone.forward_train(tokens), rms_norm(ran[-1][1], model.norm, model.cfg.rms_norm_eps))
        assert not torch.equal(alone.forward_train(tokens), model.forward_train(tokens))


def test_rope_scaling_is_not_vacuous(tiny):
    """The scaled families really get non-default frequencies (else they would test nothing new)."""
    hf, loaded = tiny
    rope_type = hf.config.rope_parameters.get("rope_type", "default")
    default = copy.deepcopy(hf.config)
    default.rope_parameters = {"rope_type": "default", "rope_theta": hf.config.rope_parameters["rope_theta"]}
    inv_default, _ = rope_inv_freq(default)
    changed = not torch.equal(loaded.model.inv_freq, inv_default) or loaded.model.rope_scaling != 1.0
    assert changed == (rope_type != "default")


def test_ragged_prefill_matches_hf(tiny):
    """Several prompts of different lengths in one forward, written to non-contiguous slots: every
    position's logits (extend) and the last ones (prefill) match transformers on each prompt alone."""
    hf, loaded = tiny
    vocab = hf.config.vocab_size
    prompts = [_random_ids(n, vocab, seed=n) for n in (7, 1, 12, 4)]
    runner = _runner(loaded, num_slots=8)
    slots = [runner.allocate() for _ in range(8)]
    refs = [hf_logits(hf, p) for p in prompts]

    full = runner.extend([slots[5], slots[2], slots[7], slots[0]], prompts)  # [B, T, V]
    for b, (p, ref) in enumerate(zip(prompts, refs)):
        assert rel_err(full[b, : len(p)], ref) <= TOL_F32, f"row {b}"

    last = runner.prefill([slots[1], slots[3], slots[4], slots[6]], prompts)  # [B, V]
    assert rel_err(last, torch.stack([r[-1] for r in refs])) <= TOL_F32
    assert [runner.length(s) for s in slots] == [4, 7, 1, 1, 12, 7, 4, 12]

    # decode steps on the prefilled rows: one token per row, ragged cache lengths
    seqs = [list(p) for p in prompts]
    for step in range(3):
        new = _random_ids(len(prompts), vocab, seed=100 + step)
        logits = runner.decode([slots[1], slots[3], slots[4], slots[6]], new)
        for seq, t in zip(seqs, new):
            seq.append(t)
        ref = torch.stack([hf_logits(hf, s)[-1] for s in seqs])
        assert rel_err(logits, ref) <= TOL_F32, f"decode step {step}"


def test_prefill_computes_a_repeated_prompt_once(tiny, monkeypatch):
    """A GRPO group's n rows of one prompt (into empty slots) are prefilled once: the other rows' KV is a
    bitwise copy of the computing row's and their logits the same row, which matches transformers; later
    decode steps on a copied slot equal those on its source. A slot that already holds entries is
    extended, never given a copy; a repeated prompt is not a repeated forward row."""
    hf, loaded = tiny
    vocab = hf.config.vocab_size
    p, q = _random_ids(9, vocab, seed=31), _random_ids(5, vocab, seed=32)
    runner = _runner(loaded, num_slots=6)
    slots = [runner.allocate() for _ in range(6)]
    runner.prefill([slots[5]], [q[:2]])  # slot 5 already holds two entries: not a copy target
    rows = []
    real_extend = runner.extend
    monkeypatch.setattr(runner, "extend", lambda s, t, **kw: rows.append(len(s)) or real_extend(s, t, **kw))
    logits = runner.prefill([slots[0], slots[1], slots[2], slots[3], slots[5]], [p, q, p, p, q[2:]])
    assert rows == [3]  # p, q and slot 5's own tail: one forward of three rows
    assert torch.equal(logits[2], logits[0]) and torch.equal(logits[3], logits[0])
    for i, ids in ((0, p), (1, q), (4, q)):  # slot 5: its two entries, then the tail
        assert rel_err(logits[i], hf_logits(hf, ids)[-1]) <= TOL_F32, i
    assert [runner.length(s) for s in slots] == [9, 5, 9, 9, 0, 5]
    for cache in (*runner.cache.keys, *runner.cache.values):
        for s in (slots[2], slots[3]):
            assert torch.equal(cache[s, :, :9], cache[slots[0], :, :9])
    nxt = _random_ids(1, vocab, seed=33)
    after = [runner.decode([s], nxt)[0] for s in (slots[0], slots[3])]
    assert torch.equal(after[0], after[1])
    assert rel_err(after[1], hf_logits(hf, p + nxt)[-1]) <= TOL_F32
    with pytest.raises(ValueError, match="must be empty"):
        runner.cache.copy(slots[0], slots[1], 3)


def test_kv_cache_allocates_lowest_first_and_moves_entries_down():
    """Slots come lowest first; `move_down` copies a slot's live entries into the lowest free slot below
    it (nothing past its length matters), frees it, and leaves a slot with no lower free one where it is."""
    from rollout_ssd.kv_cache import KVCache

    cache = KVCache(num_layers=2, num_slots=4, max_len=6, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    assert [cache.allocate() for _ in range(4)] == [0, 1, 2, 3]
    for layer in range(2):
        cache.keys[layer][3] = torch.arange(12.0).view(1, 6, 2) + 100 * layer
        cache.values[layer][3] = -cache.keys[layer][3]
    cache.lengths[3] = 4
    cache.free(1)
    cache.free(0)
    assert cache.move_down(2) == 0 and cache.lengths[0] == 0 and cache.num_free == 2  # empty: nothing copied
    assert cache.move_down(3) == 1 and cache.lengths[1] == 4 and cache.num_free == 2
    for layer in range(2):
        assert torch.equal(cache.keys[layer][1, :, :4], torch.arange(8.0).view(1, 4, 2) + 100 * layer)
        assert torch.equal(cache.values[layer][1, :, :4], -cache.keys[layer][1, :, :4])
    assert cache.move_down(0) == 0 and cache.move_down(1) == 1  # no lower free slot
    assert cache.allocate() == 2
    with pytest.raises(ValueError, match="not allocated"):
        cache.free(3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_starts_as_zeros_backed_only_where_written(dtype):
    """A CPU cache reads as zeros, takes writes like any tensor, and holds no memory until written: a
    cache of 200-400 MB (the default engine's is several GB) raises the process's resident memory by a few
    pages when made and read, by what is written after, and gives it back when dropped (Linux)."""
    import gc

    from rollout_ssd.kv_cache import KVCache, zeroed

    if not os.path.exists("/proc/self/statm"):
        pytest.skip("resident memory is read from /proc/self/statm (Linux)")

    def resident_mb() -> float:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    before = resident_mb()
    cache = KVCache(num_layers=4, num_slots=31, max_len=2048, num_kv_heads=3, head_dim=64, dtype=dtype)
    size_mb = 8 * 32 * 3 * 2048 * 64 * cache.keys[0].element_size() / 2**20
    assert size_mb >= 190
    assert resident_mb() - before < 0.05 * size_mb
    cache.keys[2][5] = 1.0  # one slot of one layer: 1.5 MB in float32
    assert resident_mb() - before < 0.05 * size_mb
    assert all(t.dtype == dtype and t.shape == (32, 3, 2048, 64) and t.is_contiguous() for t in cache.keys + cache.values)
    assert torch.count_nonzero(cache.keys[2]) == 3 * 2048 * 64 and torch.count_nonzero(cache.keys[2][5] - 1) == 0
    assert all(torch.count_nonzero(t) == 0 for t in cache.keys[:2] + cache.keys[3:] + cache.values)
    written = zeroed((64, 2**20), torch.float32)  # 256 MB, all written
    written.fill_(2.0)
    peak = resident_mb()
    assert peak - before > 200
    del written, cache
    gc.collect()
    assert peak - resident_mb() > 200  # unmapped with the tensors
    assert torch.equal(zeroed((0, 3), dtype), torch.zeros(0, 3, dtype=dtype))


def _populate_works() -> bool:
    import mmap

    from rollout_ssd.kv_cache import lazily_backed, populate

    if not lazily_backed("cpu"):
        return False
    pages = mmap.mmap(-1, 1 << 16, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return populate(torch.frombuffer(pages, dtype=torch.uint8).data_ptr(), 1 << 16) == 0


def _huge_pages_always() -> bool:
    """Transparent huge pages on for every mapping: resident memory then grows by 2 MiB pages."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not os.path.exists("/proc/self/statm") or not _populate_works() or _huge_pages_always(),
                    reason="needs Linux >= 5.14 (MADV_POPULATE_WRITE), /proc/self/statm and 4 KiB pages")
def test_kv_cache_backs_a_slot_ahead_of_its_writes_without_changing_it():
    """`back` gives a slot's positions [0, end) memory up to the next chunk boundary (one chunk of 256
    positions here: 8 tensors x 3 heads x 256 x 64 float32 = 1.5 MiB), leaves what the slot holds as it was,
    does nothing for positions already backed, and where the OS cannot, stops trying and changes nothing."""
    from rollout_ssd import kv_cache
    from rollout_ssd.kv_cache import BACK_CHUNK, KVCache

    def resident_mb() -> float:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    assert BACK_CHUNK == 256
    cache = KVCache(num_layers=4, num_slots=7, max_len=2048, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    held = torch.arange(10 * 64, dtype=torch.float32).view(10, 64)
    cache.keys[1][2, 1, :10] = held  # one page of one head
    before = resident_mb()
    cache.back([2], [200])
    grown = resident_mb() - before
    assert 1.5 - 0.1 < grown < 1.5 + 0.5, grown
    assert torch.equal(cache.keys[1][2, 1, :10], held) and torch.count_nonzero(cache.keys[1][2]) == held.count_nonzero()
    before = resident_mb()
    cache.back([2], [256])  # within what is backed: nothing to do
    for t in (*cache.keys, *cache.values):
        t[2, :, :256] = 1.0  # written where backed: no new memory
    assert resident_mb() - before < 0.2
    cache.back([2, cache.scratch_slot], [257, 3])  # the next chunk of slot 2, and the scratch slot's first
    assert resident_mb() - before > 2 * 1.5 - 0.1

    failing = KVCache(num_layers=1, num_slots=2, max_len=512, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    original = kv_cache.populate
    try:
        kv_cache.populate = lambda address, nbytes: errno.ENOMEM  # not now: tried again next time
        failing.back([0], [10])
        assert failing.backs_ahead and failing._backed == [0, 0, 0]
        kv_cache.populate = lambda address, nbytes: errno.EINVAL  # the OS cannot: not tried again
        failing.back([0], [10])
    finally:
        kv_cache.populate = original
    assert not failing.backs_ahead and failing._backed == [0, 0, 0]
    failing.back([0], [10])  # no longer tried
    assert failing._backed == [0, 0, 0]
    failing.keys[0][0, 0, :10] = 2.0  # writes still land (their own page faults)
    assert float(failing.keys[0][0].sum()) == 2.0 * 10 * 8


@pytest.mark.skipif(not _populate_works(), reason="needs Linux >= 5.14 (MADV_POPULATE_WRITE)")
def test_runner_backs_every_position_it_writes(tiny):
    """Each forward backs the slots' positions it writes (and the scratch slot's, for padded rows) first,
    and a prompt's KV copied into other slots (a GRPO group's) backs them too."""
    _, loaded = tiny
    runner = ModelRunner(loaded.model, num_slots=3, max_len=600)
    slots = [runner.allocate() for _ in range(3)]
    runner.prefill(slots, [list(range(1, 6)), [1 + i % 80 for i in range(100)], [7]])
    for _ in range(3):
        runner.decode(slots, [1, 2, 3])
    cache = runner.cache
    assert cache.backs_ahead and all(cache._backed[s] >= cache.lengths[s] for s in slots)
    assert cache._backed[slots[1]] == 256 and cache._backed[cache.scratch_slot] >= 100

    group = ModelRunner(loaded.model, num_slots=3, max_len=600)
    shared = [group.allocate() for _ in range(3)]
    group.prefill(shared, [[1 + i % 80 for i in range(300)]] * 3)  # computed in slot 0, copied into 1 and 2
    assert [group.cache._backed[s] for s in shared] == [512, 512, 512]


def test_tree_append_matches_hf(tiny):
    """A multi-token append with explicit positions and a tree mask: siblings b1 and b2 both follow a
    (same position), b2 does not see b1, c follows b2. Each token's logits equal transformers' on the
    linear sequence of its ancestors. Rows are ragged (4 and 3 new tokens, prefixes 5 and 9)."""
    hf, loaded = tiny
    vocab = hf.config.vocab_size
    prefixes = [_random_ids(5, vocab, seed=1), _random_ids(9, vocab, seed=2)]
    trees = [_random_ids(4, vocab, seed=3), _random_ids(3, vocab, seed=4)]  # [a, b1, b2, (c)]
    runner = _runner(loaded)
    slots = [runner.allocate(), runner.allocate()]
    runner.prefill(slots, prefixes)

    t_max, length = 4, max(len(p) + len(t) for p, t in zip(prefixes, trees))
    positions = torch.zeros(2, t_max, dtype=torch.long)
    mask = torch.zeros(2, t_max, length, dtype=torch.bool)
    path = [[0], [0, 1], [0, 2], [0, 2, 3]]  # each node's ancestors and itself: a, a-b1, a-b2, a-b2-c
    for b, (prefix, tree) in enumerate(zip(prefixes, trees)):
        p = len(prefix)
        for i in range(len(tree)):
            mask[b, i, :p] = True
            mask[b, i, [p + j for j in path[i]]] = True
            positions[b, i] = p + len(path[i]) - 1
    logits = runner.extend(slots, trees, positions=positions, mask=mask)  # [B, T, V]

    for b, (prefix, tree) in enumerate(zip(prefixes, trees)):
        a, b1, b2 = tree[:3]
        on_b2 = hf_logits(hf, prefix + [a, b2] + tree[3:])[len(prefix):]  # a, b2[, c]
        on_b1 = hf_logits(hf, prefix + [a, b1])[-1]
        assert rel_err(logits[b, 0], on_b2[0]) <= TOL_F32, f"row {b}: a"
        assert rel_err(logits[b, 1], on_b1) <= TOL_F32, f"row {b}: b1"
        assert rel_err(logits[b, 2], on_b2[1]) <= TOL_F32, f"row {b}: b2"
        if len(tree) == 4:
            assert rel_err(logits[b, 3], on_b2[2]) <= TOL_F32, f"row {b}: c"
        # the mask mattered: b2 seeing b1 would give other logits
        assert rel_err(logits[b, 2], hf_logits(hf, prefix + [a, b1, b2])[-1]) > 1e-3
    assert runner.length(slots[0]) == 9 and runner.length(slots[1]) == 12


def test_rollback_then_append_equals_fresh_run(tiny):
    """Append, roll back (into the appended tokens, and into the prompt), append other tokens: the
    logits equal a fresh run of the resulting sequence, and a neighbouring row is untouched."""
    hf, loaded = tiny
    vocab = hf.config.vocab_size
    prompt, other = _random_ids(6, vocab, seed=5), _random_ids(4, vocab, seed=6)
    x, y, z, u, v, w = _random_ids(6, vocab, seed=7)
    runner = _runner(loaded)
    slot, neighbour = runner.allocate(), runner.allocate()
    runner.prefill([slot, neighbour], [prompt, other])
    runner.extend([slot], [[x, y, z]])
    runner.rollback(slot, len(prompt) + 1)  # keep x, forget y, z
    assert runner.length(slot) == len(prompt) + 1
    logits = runner.extend([slot, neighbour], [[u, v], [w]])
    assert rel_err(logits[0, :2], hf_logits(hf, prompt + [x, u, v])[-2:]) <= TOL_F32
    assert rel_err(logits[1, 0], hf_logits(hf, other + [w])[-1]) <= TOL_F32

    runner.rollback(slot, 3)  # into the prompt
    logits = runner.extend([slot], [[w, u]])
    assert rel_err(logits[0], hf_logits(hf, prompt[:3] + [w, u])[-2:]) <= TOL_F32
    with pytest.raises(ValueError, match="length"):
        runner.rollback(slot, runner.length(slot) + 1)


@pytest.mark.parametrize("kind", ["avx2", "avx512"])
def test_gemm_rows_pad_to_fast_widths_and_drop_the_padding(kind, monkeypatch):
    """cpu_backend.linear and the LM head run an M-row GEMM at gemm_rows(M) rows (zero rows added: MKL is up to
    1.9x slower at widths off a multiple of 4 / 8, bench/RESULTS.md), or x @ W.T over column-major weights
    where that form is faster (by CPU kind and thread count). The padded rows must never reach the
    output: every real row equals F.linear's, and the shapes are the unpadded ones."""
    from rollout_ssd.models import cpu_backend
    from rollout_ssd.models.cpu_backend import gemm_rows, head_matmul, linear
    from rollout_ssd.models.weight_copies import WeightCopies

    monkeypatch.setattr(cpu_backend, "cpu_kind", lambda: kind)
    monkeypatch.setattr(cpu_backend.f32_rows, "_ON", False)  # MKL's forms here; the rows kernel: test_f32_rows.py
    for m in range(1, 200):
        p = gemm_rows(m)
        assert m <= p <= m + 7 and (m <= 16 or p % 8 == 0), (m, p)
    assert [gemm_rows(m) for m in (1, 2, 3, 4, 5, 15, 16, 17, 31)] == [1, 2, 4, 4, 5, 16, 16, 24, 32]
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3072, 576, generator=gen).t().contiguous().t()   # column-major, as the layers store it
    head = torch.randn(3072, 576, generator=gen)  # row-major, as the LM head is held
    bias = torch.randn(3072, generator=gen)
    few = {"avx2": 1, "avx512": 8}[kind]  # x @ W.T over the column-major storage up to this many rows
    wide = {"avx2": 10**9, "avx512": 25}[kind]  # and from this many rows on
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):  # 1 thread: 12+ rows take the column-major form too
            torch.set_num_threads(n_threads)
            for shape in ((3, 576), (1, 13, 576), (5, 3, 576), (31, 576), (7, 576), (9, 576), (24, 576), (5, 5, 576)):
                x = torch.randn(*shape, generator=gen)
                m = x.numel() // 576
                copies = WeightCopies()
                out = linear(x, w, copies, "w", bias)
                ref = torch.nn.functional.linear(x.double(), w.double(), bias.double())
                assert out.shape == ref.shape
                assert rel_err(out, ref) <= TOL_F32, (n_threads, shape)
                # the form taken: the column-major storage makes no row-major copy
                column_major = (n_threads == 1 and m >= 12) or m <= few or m >= wide
                assert len(copies) == (0 if column_major else 1), (kind, n_threads, shape)
                copies = WeightCopies()
                logits = head_matmul(x.reshape(m, 576), head, copies)
                assert rel_err(logits, x.reshape(m, 576).double() @ head.double().t()) <= TOL_F32
                assert len(copies) == (1 if m <= few else 0), (kind, shape)  # the head's column-major copy (few rows)
    finally:
        torch.set_num_threads(threads)


def test_head_logits_pad_rows_and_drop_the_padding(tiny):
    _, loaded = tiny
    model = loaded.model
    gen = torch.Generator().manual_seed(1)
    for m in (2, 3, 7, 13, 17):
        hidden = torch.randn(m, model.cfg.hidden_size, generator=gen)
        out = model.head_logits(hidden)
        ref = hidden.double() @ model.lm_head.double().t()
        assert out.shape == ref.shape
        assert rel_err(out, ref) <= TOL_F32, m


def test_multi_row_forwards_follow_in_place_weight_writes(tiny, tmp_path, request, monkeypatch):
    """Forwards over 2+ rows run on row-major copies of the frozen float32 layer weights (cpu_backend.linear,
    cpu_backend.WeightCopies). After the weights are rewritten in place (as weight sync does), or a weight
    is replaced by a new tensor, both the 1-row and the multi-row forward must compute with the new
    values: the copies may never go stale. (The CPU kind is pinned to one whose few-row linears use the
    copies: on others they read the column-major storage itself.)"""
    from rollout_ssd.models import cpu_backend

    monkeypatch.setattr(cpu_backend, "cpu_kind", lambda: "avx2")
    hf, loaded = tiny
    vocab = hf.config.vocab_size
    other = build_tiny(tmp_path, request.node.callspec.params["tiny"], seed=23)
    prompt, tail = _random_ids(5, vocab, seed=8), _random_ids(3, vocab, seed=9)
    model = copy.deepcopy(loaded.model)
    runner = ModelRunner(model, num_slots=2, max_len=32)
    slot = runner.allocate()
    runner.prefill([slot], [prompt])
    runner.extend([slot], [tail])            # builds the row-major copies
    assert any(layer.row_major._copies for layer in model.layers)
    runner.rollback(slot, 0)
    with torch.no_grad():                    # write the other model's weights in place, through HF-named views
        theirs = {k: v.detach().float() for k, v in other.state_dict().items()}
        for name, param in model.hf_parameters().items():
            if name in theirs:
                param.copy_(theirs[name])
    multi = runner.prefill([slot], [prompt + tail])[0]            # all rows in one forward
    ref = hf_logits(other, prompt + tail)[-1]
    assert rel_err(multi, ref) <= TOL_F32
    runner.rollback(slot, len(prompt) + len(tail) - 1)
    single = runner.decode([slot], [tail[-1]])[0]                 # one row
    assert rel_err(single, ref) <= TOL_F32
    assert rel_err(multi, hf_logits(hf, prompt + tail)[-1]) > 1e-3  # the write really changed the model

    # replace (not write) a weight of a fresh model whose copies exist: the new tensor's version counter
    # equals the old one's (both never written), so only its identity and address tell them apart
    model = copy.deepcopy(loaded.model)
    runner = ModelRunner(model, num_slots=2, max_len=32)
    slot = runner.allocate()
    before = runner.prefill([slot], [prompt + tail])[0]       # builds the row-major copies
    for layer in model.layers:
        new = torch.nn.Parameter(layer.w_down.detach().t().mul(0.5).contiguous().t(), requires_grad=False)
        assert new._version == layer.w_down._version
        layer.w_down = new
    runner.rollback(slot, 0)
    multi = runner.prefill([slot], [prompt + tail])[0]
    runner.rollback(slot, len(prompt) + len(tail) - 1)
    single = runner.decode([slot], [tail[-1]])[0]            # F.linear on the new tensors: no copy involved
    assert rel_err(multi, single) <= TOL_F32
    assert rel_err(multi, before) > 1e-3                     # the replacement really changed the model


# ---- the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ---------------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village by the sea,"]


@pytest.mark.slow
def test_default_state_dict_matches_transformers_gguf(default_model_f32, hf_default):
    """Our dequantized tensors equal transformers' (q/k rows un-permuted from llama.cpp's layout)."""
    ours = default_model_f32.model.hf_parameters()
    theirs = hf_default.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: our lm_head is the embedding
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.29.self_attn.q_proj.weight", "model.layers.17.self_attn.k_proj.weight"):
        assert torch.equal(ours[name], theirs[name]), name
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=1e-6, msg=name)
    assert torch.equal(default_model_f32.model.lm_head, theirs["lm_head.weight"])


def _default_batch(loaded):
    return [loaded.tokenizer(p).input_ids for p in PROMPTS]


@pytest.mark.slow
def test_default_fp32_logits_match_transformers_gguf(default_model_f32, hf_default):
    """Ragged prefill of three prompts (all positions), then two batched decode steps, float32."""
    prompts = _default_batch(default_model_f32)
    runner = _runner(default_model_f32, num_slots=3, max_len=64)
    slots = [runner.allocate() for _ in prompts]
    full = runner.extend(slots, prompts)
    seqs = [list(p) for p in prompts]
    for b, p in enumerate(prompts):
        assert rel_err(full[b, : len(p)], hf_logits(hf_default, p)) <= TOL_F32_DEFAULT, f"row {b}"
    for step in range(2):
        new = [int(full[b, len(s) - 1].argmax()) for b, s in enumerate(seqs)] if step == 0 else [28, 29, 30]
        logits = runner.decode(slots, new)
        for s, t in zip(seqs, new):
            s.append(t)
        ref = torch.stack([hf_logits(hf_default, s)[-1] for s in seqs])
        assert rel_err(logits, ref) <= TOL_F32_DEFAULT, f"decode step {step}"


@pytest.mark.slow
def test_default_bf16_logits_within_bf16_rounding(default_model_f32, hf_default):
    """bfloat16 against the float32 reference (transformers, float32) and transformers' own bfloat16.

    Measured (8 prompts, 106 positions, logits up to |39|): max |ours_bf16 - f32| 1.34 and
    max |hf_bf16 - f32| 1.34 (both grow with prompt length), max |ours_bf16 - hf_bf16| 1.03 (0.69 on
    the three prompts here), mean |ours_bf16 - f32| 0.12-0.25; the argmax flipped at 2 of 106
    positions, both where float32's top-2 margin was < 0.07, and transformers' bf16 flipped at 2 too.
    Bounds: (1) our max error against float32 is at most 2x transformers' bf16 max error (flash-attention's
    rule); (2) max |ours_bf16 - hf_bf16| <= 1.5 and mean |ours_bf16 - f32| <= 0.35; (3) the argmax equals
    float32's wherever float32's top-2 margin exceeds 1.0, i.e. bf16 may flip near-ties only.

    Our bf16 model is `build_decoder(config, float32 state, bfloat16)`: exactly what
    load_pretrained(dtype="bfloat16") builds (the GGUF is dequantized to float32, then cast), without
    parsing the GGUF again. transformers' is its float32 GGUF model cast the same way."""
    ours = copy.copy(default_model_f32)
    ours.model = build_decoder(default_model_f32.hf_config, default_model_f32.model.hf_parameters(), torch.bfloat16)
    assert ours.model.embed.dtype == torch.bfloat16
    hf_bf16 = copy.deepcopy(hf_default).to(torch.bfloat16)
    prompts = _default_batch(default_model_f32)
    runner = _runner(ours, num_slots=3, max_len=64)
    full = runner.extend([runner.allocate() for _ in prompts], prompts)
    ours_err = hf_err = cross = 0.0
    for b, p in enumerate(prompts):
        ref = hf_logits(hf_default, p)
        theirs = hf_logits(hf_bf16, p)
        mine = full[b, : len(p)]
        ours_err = max(ours_err, float((mine - ref).abs().max()))
        hf_err = max(hf_err, float((theirs - ref).abs().max()))
        cross = max(cross, float((mine - theirs).abs().max()))
        assert float((mine - ref).abs().mean()) <= 0.35, f"row {b}"
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1.0
        assert torch.equal(mine.argmax(-1)[clear], ref.argmax(-1)[clear]), f"row {b}"
    assert ours_err <= 2 * hf_err, (ours_err, hf_err)
    assert cross <= 1.5, cross


def test_dtype_auto_is_the_cpu_backends_pick():
    """dtype "auto" is decided once, by the CPU backend: bfloat16 exactly where bf16 matmuls run natively
    (CUDA, or a CPU with bf16 units) or the bf16 rows kernel's widened build runs (AVX-512 without bf16
    units), float32 elsewhere, with a line saying which and why."""
    from rollout_ssd.kernels import bf16_rows
    from rollout_ssd.models import cpu_dtype
    from rollout_ssd.models.loader import parse_dtype

    assert cpu_dtype.cpu_kind() in ("amx", "avx512_bf16", "avx512", "avx2", "default")
    widened = cpu_dtype.cpu_kind() == "avx512" and bf16_rows.available() and not torch.cuda.is_available()
    assert cpu_dtype.widened_bf16() == widened
    expected = torch.bfloat16 if cpu_dtype.native_bf16() or widened else torch.float32
    assert parse_dtype("auto") == cpu_dtype.auto_dtype() == expected
    line = cpu_dtype.describe_auto_dtype()
    assert line.startswith("bfloat16" if expected == torch.bfloat16 else "float32") and "\n" not in line


@pytest.mark.parametrize("kind, onednn_says, kernel, want", [
    ("amx", True, "amx", torch.bfloat16), ("avx512_bf16", True, "dot", torch.bfloat16),
    ("avx512", True, "widened", torch.bfloat16),  # the widened rows kernel reads bf16 at memory speed
    ("avx512", True, None, torch.float32),  # no kernel: oneDNN emulates bf16 there (widened to float32), slower
    ("avx2", False, None, torch.float32), ("default", False, None, torch.float32)])
def test_dtype_auto_wants_bf16_units_or_the_widened_kernel_not_onednns_emulation(monkeypatch, kind, onednn_says,
                                                                                  kernel, want):
    from rollout_ssd.kernels import bf16_rows
    from rollout_ssd.models import cpu_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cpu_dtype, "cpu_kind", lambda: kind)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn_says)
    monkeypatch.setattr(bf16_rows, "variant", lambda: kernel)
    monkeypatch.setattr(bf16_rows, "available", lambda: kernel is not None)
    assert cpu_dtype.auto_dtype() == want
    line = cpu_dtype.describe_auto_dtype()
    assert line.startswith(str(want).removeprefix("torch.")) and f"CPU {kind}" in line
    assert ("widens bf16 weights" in line) == (kernel == "widened")
