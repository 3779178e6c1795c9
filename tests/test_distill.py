"""Draft distillation (rollout_ssd.draft) on a tiny random Llama, and the committed default draft."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rollout_ssd.draft import acceptance, build, checkpoint, loss, on_policy, prompts, teacher, train
from rollout_ssd.models.loader import load_pretrained
from tests.support.models import build_tiny


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_target")
    # a peakier random model (head, and so the tied embedding, x 8), so the KL has something to learn
    build_tiny(path, init="transformers", logit_scale=8.0, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    return load_pretrained(str(path), dtype="float32", with_tokenizer=False)


@pytest.fixture(scope="module")
def tiny_data(tiny_target):
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (int(torch.randint(3, 8, (), generator=gen)),), generator=gen).tolist()
               for _ in range(12)]
    temps = [1.0, 0.7, 0.0] * 4
    return on_policy.sample_with_teacher(tiny_target.model, prompts, temps, max_new_tokens=12, top_k=16,
                                       batch_size=5, seed=0)


def test_build_prompts_splits_by_template():
    split = prompts.build_prompts(200, 40, seed=0)
    assert len(split.train) == 200 and len(split.heldout) == 40
    assert not set(split.train) & set(split.heldout)
    assert len(set(split.train)) == 200
    assert any("How many" in p for p in split.train)  # arithmetic word problems are in the mix
    assert split == prompts.build_prompts(200, 40, seed=0)


def test_varied_prompts_stay_apart_from_every_held_out_set():
    """The varied kinds add forms the draft trains on; they must never be a held-out prompt (the recipe's
    held-out templates), an unseen-set prompt (training prompts 7900-7999 of 8000), nor reuse a held-out
    template's wording, so both held-out acceptances still measure prompts the draft never saw."""
    import string

    from rollout_ssd.draft import varied_prompts

    varied = varied_prompts.build_varied_prompts(3000, seed=0)
    assert len(varied) == 3000 == len(set(varied))
    assert varied == varied_prompts.build_varied_prompts(3000, seed=0)
    split = prompts.build_prompts(8000, 32, seed=0)
    assert not set(varied) & (set(split.heldout) | set(split.train))
    for kind_templates in prompts._TEMPLATES.values():  # each kind's held-out template: its fixed wording
        pieces = [lit.strip() for lit, *_ in string.Formatter().parse(kind_templates[-1]) if len(lit.strip()) > 12]
        assert pieces
        for piece in pieces:
            assert not any(piece in v for v in varied), piece
    kinds = {k: 0 for k in varied_prompts._TEMPLATES}
    for text in varied[:len(kinds) * 20]:
        for kind, templates in varied_prompts._TEMPLATES.items():
            kinds[kind] += any(_matches(t, text) for t in templates)
    assert all(kinds.values()), kinds  # every kind is in the rotation


def _matches(template: str, text: str) -> bool:
    import re
    import string

    pattern = "".join(re.escape(lit) + (".+?" if field is not None else "")
                      for lit, field, _, _ in string.Formatter().parse(template))
    return re.fullmatch(pattern, text, flags=re.S) is not None


def test_varied_prompts_interleave_in_turn():
    from rollout_ssd.draft.varied_prompts import interleave

    assert interleave(["a", "b", "c"], ["1"]) == ["a", "1", "b", "c"]
    assert interleave([], ["1", "2"]) == ["1", "2"]
    assert interleave(["a", "b"], ["1", "2"]) == ["a", "1", "b", "2"]


def test_recipe_prompt_mix(monkeypatch):
    """--prompt-mix varied takes its originals from --original-range, in turn with varied prompts; the
    default keeps build_prompts' training prompts as they were."""
    import recipes.distill_draft as recipe

    split = prompts.build_prompts(300, 8, seed=0)
    args = recipe.parse_args(["--out", "x", "--prompt-mix", "varied", "--original-range", "100:150"])
    texts = recipe.training_texts(args, split)
    assert len(texts) == 100 and texts[1::2] == split.train[100:150]
    assert recipe.training_texts(recipe.parse_args(["--out", "x"]), split) == split.train
    full = prompts.build_prompts(8000, 8, seed=0)  # the benches' unseen set never enters the data
    args = recipe.parse_args(["--out", "x", "--prompt-mix", "varied", "--original-range", "7890:8000"])
    assert recipe.training_texts(args, full)[1::2] == full.train[7890:7900]
    with pytest.raises(SystemExit):
        recipe.parse_args(["--out", "x", "--reselect-head"])
    with pytest.raises(SystemExit):
        recipe.parse_args(["--out", "x", "--grow-layers", "4"])


def test_recipe_checks_a_grown_drafts_size_before_the_work():
    """--grow-layers makes the warm start deeper: the size the recipe checks before sampling or training is
    the grown draft's (the package's limit refuses four layers of the default draft's shape; a candidate
    without a limit is allowed, and its size grows by two layers' weights)."""
    from dataclasses import replace

    from transformers import AutoConfig

    import recipes.distill_draft as recipe
    from rollout_ssd.models.config import model_config_from_hf

    path = str(Path(checkpoint.__file__).parent.parent / "assets/drafts/smollm2-135m-instruct-draft")
    draft_cfg = model_config_from_hf(AutoConfig.from_pretrained(path, local_files_only=True))
    target = SimpleNamespace(cfg=replace(draft_cfg, num_layers=30, head_vocab_size=None))  # SmolLM2-135M's depth
    two = recipe.check_size_first(recipe.parse_args(["--out", "x", "--init-from", path]), target)
    with pytest.raises(checkpoint.CheckpointTooLarge):
        recipe.check_size_first(recipe.parse_args(["--out", "x", "--init-from", path, "--grow-layers", "4"]), target)
    four = recipe.check_size_first(recipe.parse_args(["--out", "x", "--init-from", path, "--grow-layers", "4",
                                                      "--max-checkpoint-bytes", "0"]), target)
    cfg = target.cfg
    layer = 2 * (cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + cfg.num_heads *
                 cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size + 2 * cfg.hidden_size)
    assert 0 <= four - two - 2 * layer < 4096  # two layers' bfloat16 weights, and their names in the file's header
    for depth in ("2", "0", str(cfg.num_layers + 1)):  # not deeper than the warm start, or deeper than the target
        with pytest.raises(ValueError, match="--grow-layers"):
            recipe.check_size_first(recipe.parse_args(["--out", "x", "--init-from", path, "--grow-layers", depth,
                                                       "--max-checkpoint-bytes", "0"]), target)


def test_teacher_records_match_a_separate_teacher_pass(tiny_target, tiny_data):
    """The top-k recorded while sampling equals the top-k of a forward over prompt + completion."""
    sample = tiny_data[0]
    again = teacher.teacher_topk(tiny_target.model, [sample.token_ids], [sample.prompt_len], top_k=16)[0]
    assert torch.equal(again.topk_ids, sample.topk_ids)
    torch.testing.assert_close(again.topk_logp.float(), sample.topk_logp.float(), atol=2e-3, rtol=0)


def test_teacher_records_follow_slot_moves_and_shared_prompts(tiny_target):
    """The tap tracks sequences by the forwards it sees; the runner also copies KV between slots without a
    forward (a repeated prompt prefilled once; a sequence moved down when others finish early). Every
    sequence's recorded rows still equal a separate teacher pass over its tokens, moves and copies seen."""
    from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig
    from rollout_ssd.models.loader import LoadedModel

    tap = on_policy.TeacherTap(tiny_target.model, top_k=8)
    engine = RolloutEngine(LoadedModel(model=tap, hf_config=None, tokenizer=None, source="teacher"),
                           SpecConfig(method="ar"), EngineConfig(max_batch_size=8, max_model_len=64))
    events = []
    engine.runner.cache.observers += [tap.on_copy, lambda *e: events.append(e[-1])]
    prompts = [[5, 6, 7], [9, 10, 11, 12], [5, 6, 7]]
    with engine:
        engine.pause()  # both requests join one batch: the early one's slots free up under the other
        short = engine.submit(prompts, SamplingParams(temperature=1.0, max_new_tokens=3, seed=1, n=2))
        long = engine.submit(prompts, SamplingParams(temperature=0.0, max_new_tokens=10))
        engine.resume()
        results = short.result(timeout=60) + long.result(timeout=60)
    assert True in events and False in events  # moved down, and a prompt's KV copied
    for r in results:
        rows = tap.records(list(r.prompt_token_ids), list(r.token_ids))
        again = teacher.teacher_topk(tiny_target.model, [list(r.prompt_token_ids) + list(r.token_ids)],
                                     [len(r.prompt_token_ids)], top_k=8)[0]
        assert torch.equal(torch.stack([row[0] for row in rows]), again.topk_ids)


def test_teacher_sampling_stops_at_the_deadline(tiny_target):
    """Past the deadline no prompt starts: nothing is sampled, and no sample is returned."""
    import time

    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    assert on_policy.sample_with_teacher(tiny_target.model, prompts, [1.0, 0.0], max_new_tokens=4,
                                         deadline=time.monotonic() - 1.0) == []
    assert on_policy.sample_continuations(tiny_target.model, prompts, [1.0, 0.0], 4,
                                          deadline=time.monotonic() - 1.0) == [[], []]


def test_distillation_reduces_kl(tiny_target, tiny_data):
    head = build.select_head_tokens(tiny_data, 48, always=[2])
    draft = build.make_draft(tiny_target.model, head, num_layers=1)
    before = loss.eval_kl(draft, tiny_data)
    stats = train.train_draft(draft, tiny_data, train.DistillConfig(lr=3e-3, warmup_steps=2, batch_tokens=40,
                                                                       minutes=1.0, max_steps=60))
    after = loss.eval_kl(draft, tiny_data)
    assert stats.steps == 60
    assert after < 0.5 * before, (before, after)
    assert not any(p.requires_grad for p in draft.parameters())
    assert draft.embed is tiny_target.model.embed  # shared, never trained


def test_saved_draft_reloads_with_shared_embedding(tiny_target, tiny_data, tmp_path):
    head = build.select_head_tokens(tiny_data, 40, always=[2])
    draft = build.make_draft(tiny_target.model, head, num_layers=2)
    with torch.no_grad():
        for p in build.trainable_parameters(draft):
            p.add_(0.01 * torch.randn_like(p))
    build.round_weights(draft)
    hf = build.draft_hf_config(tiny_target.hf_config, 2, len(head))
    size = checkpoint.save_draft(draft, hf, tmp_path)
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "model.safetensors"))
    assert "model.embed_tokens.weight" not in stored
    assert stored["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert size == (tmp_path / "model.safetensors").stat().st_size
    with pytest.raises(ValueError, match="shares its target"):
        load_pretrained(str(tmp_path), dtype="float32", with_tokenizer=False)
    loaded = load_pretrained(str(tmp_path), dtype="float32", with_tokenizer=False,
                             share_embedding_from=tiny_target.model).model
    assert loaded.cfg.head_vocab_size == 40 and loaded.cfg.num_layers == 2
    assert torch.equal(loaded.head_token_ids, head)
    tokens = torch.tensor([tiny_data[1].token_ids, tiny_data[2].token_ids[:len(tiny_data[1].token_ids)]])
    with torch.no_grad():
        expected = draft.logits(draft.forward_train(tokens))
        got = loaded.logits(loaded.forward_train(tokens))
    assert torch.equal(got, expected)
    assert torch.isinf(got[..., [t for t in range(96) if t not in set(head.tolist())]]).all()


def test_rehead_keeps_trained_rows_and_layers(tiny_target, tiny_data):
    """A head chosen again: tokens in both heads keep the trained draft's rows (so their logits are
    unchanged), new tokens get the target's output rows, every layer stays as trained, and a token
    dropped from the head can no longer be drafted."""
    target = tiny_target.model
    old = torch.arange(3, 43)
    new = torch.cat([torch.tensor([2]), torch.arange(23, 63)])  # 20 kept (23..42), 21 new
    draft = build.make_draft(target, old, num_layers=2)
    with torch.no_grad():
        for p in build.trainable_parameters(draft):
            p.add_(0.05 * torch.randn_like(p))
    before = {k: v.clone() for k, v in draft.hf_parameters().items()}
    again = build.rehead(draft, target, new)
    assert torch.equal(again.head_token_ids, new) and again.cfg.head_vocab_size == len(new)
    assert all(torch.equal(draft.hf_parameters()[k], v) for k, v in before.items())  # the old draft untouched
    for name, tensor in again.hf_parameters().items():
        if not name.startswith("lm_head") and name != "model.embed_tokens.weight":
            assert torch.equal(tensor, before[name]), name
    assert again.embed is target.embed
    tokens = torch.tensor([tiny_data[1].token_ids])
    with torch.no_grad():
        a, b = draft.logits(draft.forward_train(tokens)), again.logits(again.forward_train(tokens))
    kept = list(range(23, 43))
    assert torch.equal(a[..., kept], b[..., kept])
    torch.testing.assert_close(again.lm_head[torch.isin(new, old, invert=True)],
                               target.lm_head[new[torch.isin(new, old, invert=True)]].float(), rtol=0, atol=0)
    assert torch.isinf(b[..., list(range(3, 23))]).all() and torch.isfinite(b[..., [2] + list(range(43, 63))]).all()
    assert all(p.requires_grad for p in build.trainable_parameters(again))
    with pytest.raises(ValueError, match="full head"):
        build.rehead(target, target, new)


def test_grow_adds_target_layers_that_change_nothing_until_trained(tiny_target, tiny_data):
    """A trained draft grown deeper: its layers, norm and head are kept, the new layers are the target's
    next ones with their output projections zeroed, so the grown draft's logits equal the old draft's
    exactly; one training step moves the new layers (the zeroed projections get gradients), so they
    can learn."""
    target = tiny_target.model
    draft = build.make_draft(target, torch.arange(2, 60), num_layers=1)
    with torch.no_grad():
        for p in build.trainable_parameters(draft):
            p.add_(0.05 * torch.randn_like(p))
    before = {k: v.clone() for k, v in draft.hf_parameters().items()}
    grown = build.grow(draft, target, 3)
    assert len(grown.layers) == 3 and grown.cfg.num_layers == 3 and grown.embed is target.embed
    assert torch.equal(grown.head_token_ids, draft.head_token_ids)
    assert all(torch.equal(draft.hf_parameters()[k], v) for k, v in before.items())  # the old draft untouched
    params, src = grown.hf_parameters(), target.hf_parameters()
    for name, tensor in before.items():
        if name != "model.embed_tokens.weight":
            assert torch.equal(params[name], tensor), name
    for i in (1, 2):
        for part, weight in params.items():
            if part.startswith(f"model.layers.{i}."):
                zeroed = part.endswith(("o_proj.weight", "down_proj.weight"))
                assert torch.equal(weight, torch.zeros_like(weight) if zeroed else src[part].float()), part
    tokens = torch.tensor([s.token_ids for s in tiny_data[:1]])
    with torch.no_grad():
        assert torch.equal(draft.logits(draft.forward_train(tokens)), grown.logits(grown.forward_train(tokens)))
    new_layer = [grown.hf_parameters()[f"model.layers.2.{n}"].clone() for n in ("mlp.down_proj.weight",
                                                                               "self_attn.o_proj.weight")]
    train.train_draft(grown, tiny_data, train.DistillConfig(lr=1e-2, batch_tokens=64, max_steps=2, warmup_steps=1))
    assert all(not torch.equal(grown.hf_parameters()[f"model.layers.2.{n}"], w) for n, w in
               zip(("mlp.down_proj.weight", "self_attn.o_proj.weight"), new_layer))
    with pytest.raises(ValueError, match="num_layers"):
        build.grow(draft, target, 1)
    with pytest.raises(ValueError, match="num_layers"):
        build.grow(draft, target, len(target.layers) + 1)
    with pytest.raises(ValueError, match="full head"):
        build.grow(target, target, len(target.layers))


def test_checkpoint_size_is_checked_before_training(tiny_target, tiny_data, tmp_path):
    """The checkpoint's size is known from the draft's config alone (parameters x dtype bytes, the
    shared embedding left out): it is exactly what save_draft stores, so a draft over the limit is
    refused before the first training step, not after the run. A save refused at the end still keeps
    the weights (beside the target folder, never in it)."""
    from safetensors.torch import load_file

    head = build.select_head_tokens(tiny_data, 40, always=[2])
    cfg = build.draft_config(tiny_target.model.cfg, 2, len(head))
    draft = build.make_draft(tiny_target.model, head, num_layers=2)
    assert draft.cfg == cfg
    size = checkpoint.save_draft(draft, build.draft_hf_config(tiny_target.hf_config, 2, len(head)), tmp_path / "ok")
    stored = load_file(str(tmp_path / "ok" / "model.safetensors"))
    assert sum(t.numel() * t.element_size() for t in stored.values()) == checkpoint.tensor_bytes(cfg)
    assert size <= checkpoint.checkpoint_bytes(cfg) == checkpoint.check_checkpoint_size(cfg, max_bytes=size + 4096)

    with pytest.raises(checkpoint.CheckpointTooLarge, match="over the"):
        checkpoint.check_checkpoint_size(cfg, max_bytes=size - 1)
    before = [p.detach().clone() for p in build.trainable_parameters(draft)]
    too_small = train.DistillConfig(max_steps=5, warmup_steps=1, batch_tokens=40, max_checkpoint_bytes=size - 1)
    with pytest.raises(checkpoint.CheckpointTooLarge):
        train.train_draft(draft, tiny_data, too_small)
    assert all(torch.equal(a, b) for a, b in zip(before, build.trainable_parameters(draft)))  # no step taken
    with pytest.raises(ValueError, match="max_checkpoint_bytes"):
        train.DistillConfig(max_checkpoint_bytes=0)

    with pytest.raises(checkpoint.CheckpointTooLarge, match="kept in") as refused:
        checkpoint.save_draft(draft, {"model_type": "llama"}, tmp_path / "small", max_bytes=size - 1)
    assert refused.value.kept_at == tmp_path / "small.oversize"
    assert not (tmp_path / "small" / "model.safetensors").exists()
    kept = load_file(str(refused.value.kept_at / "model.safetensors"))
    assert all(torch.equal(kept[name], stored[name]) for name in stored)


def test_measure_acceptance_identical_draft_accepts_everything(tiny_target):
    """A 'draft' that is the target itself: greedy acceptance 1, T=1 acceptance 1 (up to rounding)."""
    model = tiny_target.model
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    greedy = acceptance.measure_acceptance(model, model, prompts, 0.0, max_new_tokens=6, batch_size=2)
    sampled = acceptance.measure_acceptance(model, model, prompts, 1.0, max_new_tokens=6, batch_size=2)
    assert greedy.accept_rate == 1.0 and greedy.positions > 0
    assert sampled.accept_rate == pytest.approx(1.0, abs=1e-5)


DEFAULT_DRAFT = Path(__file__).resolve().parent.parent / "rollout_ssd/assets/drafts/smollm2-135m-instruct-draft"


@pytest.mark.skipif(not (DEFAULT_DRAFT / "config.json").is_file(), reason="default draft not built yet")
def test_committed_default_draft():
    from transformers import AutoConfig

    from rollout_ssd.models.registry import resolve_draft

    path = Path(resolve_draft("default", "smollm2-135m-instruct"))
    assert path == DEFAULT_DRAFT
    assert (path / "model.safetensors").stat().st_size <= 25_000_000
    from rollout_ssd.models.config import model_config_from_hf
    assert (path / "PROVENANCE.md").is_file()
    cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
    assert cfg.model_type == "llama" and cfg.num_hidden_layers == 2
    assert cfg.shares_target_embedding and not cfg.tie_word_embeddings
    assert cfg.head_vocab_size == 8192
    # the size check made before training bounds the committed file from above
    assert checkpoint.check_checkpoint_size(model_config_from_hf(cfg)) >= (path / "model.safetensors").stat().st_size
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert "model.embed_tokens.weight" not in keys
        assert f.get_slice("lm_head.weight").get_shape() == [8192, cfg.hidden_size]
        assert f.get_slice("lm_head.token_ids").get_shape() == [8192]
    # The full load, with a stand-in for the target's embedding (loading the real target takes ~30 s).
    stand_in = SimpleNamespace(embed=torch.zeros(cfg.vocab_size, cfg.hidden_size))
    draft = load_pretrained(str(path), dtype="float32", with_tokenizer=False, share_embedding_from=stand_in).model
    assert draft.cfg.head_vocab_size == 8192 and draft.head_token_ids.unique().numel() == 8192
    assert set(draft.cfg.eos_token_ids) <= set(draft.head_token_ids.tolist())
    assert draft.embed.data_ptr() == stand_in.embed.data_ptr()


def test_data_cache_round_trips_without_unpickling(tmp_path):
    """The distillation data cache holds plain data and tensors only: torch.load(weights_only=True)
    reads it back to the same samples; a file of another format is refused."""
    import torch

    from rollout_ssd.draft.teacher import TeacherSample, load_samples, save_samples

    samples = [TeacherSample([1, 2, 3, 4], 2, torch.tensor([[3, 5], [4, 6]], dtype=torch.int32),
                             torch.tensor([[-0.1, -2.0], [-0.3, -1.5]], dtype=torch.float16)),
               TeacherSample([7, 8], 2, torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, 2, dtype=torch.float16))]
    path = tmp_path / "cache.pt"
    save_samples(path, samples, next_prompt=17)
    back, next_prompt = load_samples(path)
    assert next_prompt == 17 and len(back) == 2
    for a, b in zip(samples, back):
        assert a.token_ids == b.token_ids and a.prompt_len == b.prompt_len
        assert torch.equal(a.topk_ids, b.topk_ids) and torch.equal(a.topk_logp, b.topk_logp)
    torch.save({"something": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="teacher-samples-v1"):
        load_samples(tmp_path / "other.pt")


def test_data_cache_records_the_prompt_list_its_index_counts_in(tmp_path):
    """A run that samples on from a cache must use the prompt list the cache's next_prompt indexes: the
    recipe records the options that make that list, and a cache from another list is refused naming them
    (a cache from before the record, or a run that only trains on the cache, is not checked)."""
    import torch

    import recipes.distill_draft as recipe
    from rollout_ssd.draft.teacher import TeacherSample, check_prompt_set, load_cache, save_samples

    samples = [TeacherSample([1, 2, 3], 1, torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.float16))]
    templates = recipe.prompt_set(recipe.parse_args(["--out", "x"]))
    varied = recipe.prompt_set(recipe.parse_args(["--out", "x", "--prompt-mix", "varied", "--original-range", "10:20"]))
    assert templates == {"target": "smollm2-135m-instruct", "num_prompts": templates["num_prompts"],
                         "heldout_prompts": templates["heldout_prompts"], "seed": 0, "prompt_mix": "templates"}
    assert varied == {**templates, "prompt_mix": "varied", "original_range": "10:20"}
    path = tmp_path / "cache.pt"
    save_samples(path, samples, next_prompt=5, prompt_set=varied)
    cache = load_cache(path)
    assert cache.next_prompt == 5 and cache.prompt_set == varied
    check_prompt_set(path, cache.prompt_set, varied)
    with pytest.raises(ValueError, match=r"prompt_mix: cache 'varied', this run 'templates'"):
        check_prompt_set(path, cache.prompt_set, templates)
    other_range = recipe.prompt_set(recipe.parse_args(["--out", "x", "--prompt-mix", "varied", "--original-range", "10:30"]))
    with pytest.raises(ValueError, match=r"original_range: cache '10:20', this run '10:30'"):
        check_prompt_set(path, cache.prompt_set, other_range)
    save_samples(path, samples, next_prompt=5)  # as caches were made before the record
    cache = load_cache(path)
    assert cache.next_prompt == 5 and cache.prompt_set == {}
    check_prompt_set(path, cache.prompt_set, templates)


def test_recipe_size_limit_defaults_to_the_packages_and_can_be_lifted():
    """recipes/distill_draft: the package's limit unless told (a candidate draft measured from outside
    the package may be larger: 0 lifts it, for the up-front check, the training check and the save)."""
    from recipes.distill_draft import parse_args, size_limit

    base = ["--out", "x"]
    assert size_limit(parse_args(base)) == checkpoint.MAX_CHECKPOINT_BYTES
    assert size_limit(parse_args(base + ["--max-checkpoint-bytes", "0"])) is None
    assert size_limit(parse_args(base + ["--max-checkpoint-bytes", "1234"])) == 1234


def test_provenance_names_the_drafts_own_layer_count(tmp_path):
    """A warm-started draft keeps its checkpoint's layers whatever --layers says: the provenance text
    names the draft's own count (and says the warm start made that initialisation)."""
    from types import SimpleNamespace

    import recipes.distill_draft as recipe
    from rollout_ssd.draft import prompts, train

    args = recipe.parse_args(["--out", "x", "--init-from", "some/draft", "--layers", "6"])
    split = prompts.build_prompts(40, 4, 0)
    stats = SimpleNamespace(steps=3, seconds=60.0, positions_seen=100, first_loss=2.0, last_loss=1.0)
    rate = SimpleNamespace(accept_rate=0.5, positions=10, sequences=2)
    cost = {1: {"target_s": 0.03, "draft_s": 0.005, "ratio": 0.17}}
    path = tmp_path / "PROVENANCE.md"
    recipe.write_provenance(path, "cmd", args, split, 1000, 10, 60.0, list(range(8)), 0.9, train.DistillConfig(),
                            stats, rate, rate, cost, 2, 12345, {})
    text = path.read_text()
    assert "- 2 Llama layers" in text and "first\n  2 layers and final norm (by the run that made the warm start)" in text
    assert "6 Llama layers" not in text and "Warm-started from `some/draft`" in text


def test_recipe_checks_the_prompt_list_only_where_it_samples_on(tmp_path, monkeypatch, caplog):
    """`sample_data` refuses to sample on from a cache of another prompt list, trains from it where it
    holds the tokens asked for already, and samples on from a cache made before the record (with a
    warning), which then records this run's list."""
    import logging

    import torch

    import recipes.distill_draft as recipe
    from rollout_ssd.draft import on_policy
    from rollout_ssd.draft.teacher import TeacherSample, load_cache, save_samples

    def sample(n):
        return [TeacherSample([1, 2, 3, 4], 2, torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.float16))
                for _ in range(n)]

    asked = []

    def sample_with_teacher(target, prompts, *args, **kwargs):
        asked.append(len(prompts))
        assert target is model and torch.get_num_threads() == 2  # --sample-threads' count while sampling
        return sample(len(prompts))

    monkeypatch.setattr(on_policy, "sample_with_teacher", sample_with_teacher)
    path = tmp_path / "cache.pt"
    other = {**recipe.prompt_set(recipe.parse_args(["--out", "x"])), "seed": 5}
    save_samples(path, sample(3), next_prompt=3, prompt_set=other)  # 6 completion tokens
    base = ["--out", "x", "--data-cache", str(path), "--chunk-prompts", "2", "--sample-dtype", "float32"]
    model = SimpleNamespace(embed=torch.zeros(1))  # a float32 target: it samples itself
    samples, _ = recipe.sample_data(recipe.parse_args(base + ["--tokens", "6"]), model, [[1]] * 10, 2)
    assert len(samples) == 3 and asked == []  # enough already: trained from as it is
    with pytest.raises(ValueError, match="seed: cache 5, this run 0"):
        recipe.sample_data(recipe.parse_args(base + ["--tokens", "8"]), model, [[1]] * 10, 2)
    assert asked == []
    save_samples(path, sample(3), next_prompt=3)  # from before the record
    args = recipe.parse_args(base + ["--tokens", "8"])
    with caplog.at_level(logging.WARNING, logger=recipe.log.name):
        samples, _ = recipe.sample_data(args, model, [[1]] * 10, 2)
    assert asked == [2] and len(samples) == 5 and "records no prompt list" in caplog.text
    assert torch.get_num_threads() == 1  # training's count again (conftest's)
    assert load_cache(path).prompt_set == recipe.prompt_set(args) and load_cache(path).next_prompt == 5


def test_recipe_samples_in_the_dtype_asked(tiny_target):
    """--sample-dtype: the float32 target samples itself; another dtype (and "auto" where it resolves to one)
    is the same checkpoint loaded again in that dtype, each weight the float32 one rounded to it."""
    import recipes.distill_draft as recipe
    from rollout_ssd.models.loader import parse_dtype

    model = tiny_target.model
    base = ["--out", "x", "--target", tiny_target.source]
    assert recipe.sampling_model(recipe.parse_args(base + ["--sample-dtype", "float32"]), model) is model
    bf16 = recipe.sampling_model(recipe.parse_args(base + ["--sample-dtype", "bfloat16"]), model)
    assert bf16 is not model and bf16.embed.dtype == torch.bfloat16
    for (name, mine), theirs in zip(bf16.named_parameters(), model.parameters()):
        assert torch.equal(mine, theirs.to(torch.bfloat16)), name
    auto = recipe.sampling_model(recipe.parse_args(base), model)
    assert auto.embed.dtype == parse_dtype("auto") and (auto is model) == (parse_dtype("auto") == torch.float32)
    assert recipe.sample_dtype(recipe.parse_args(base + ["--sample-dtype", "bfloat16"])) == "bfloat16"
