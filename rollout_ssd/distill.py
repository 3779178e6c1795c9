"""Distilling a small draft from its target: on-policy data, forward KL, held-out acceptance.

Recipe (issue "default draft"; recipes/distill_draft.py wires it, an RL "draft follows the learner"
mode reuses the pieces):
1. Prompts are built procedurally (templates x topics x tasks; no downloads). Held-out prompts come
   from templates the training split never uses, filled from a different seed.
2. On-policy data: the target samples completions with the engine's sampling law (`sampling.py`:
   the same `target_probs`, `draw_tokens` and per-sequence generators), through our `ModelRunner`.
   The logits the sampler already computed at each completion position ARE the teacher's
   distributions there, so we keep their top-k log-probs on the fly (`sample_with_teacher`) instead of
   running the target a second time over prompt + completion (on a CPU that second pass costs about
   as much as sampling). `teacher_topk` does the separate pass for sequences made elsewhere (engine
   rollouts in RL).
3. The draft: the target's first L layers and final norm, the target's embedding shared and frozen
   (not stored), and an LM head restricted to the N most frequent completion tokens, initialised
   from the target's output rows of those tokens. Verification stays exact with a restricted head:
   q is the distribution the draft sampled from, and it is 0 outside the head.
4. Loss: forward KL(p || q) per completion position, with p the teacher's top-k probabilities
   restricted to tokens the head has and renormalised over them (the tail mass outside the top-k
   and outside the head is dropped: q can never match it, and at the optimum of the cross-entropy
   with unnormalised weights q equals the renormalised p anyway). AdamW, linear warm-up then a
   cosine decay driven by elapsed wall-clock time, so a time budget ends at the bottom of the schedule.
5. `measure_acceptance` runs target and draft in lockstep along target-sampled continuations and
   averages the exact expected SD acceptance per token: sum_x min(p_T(x), q_T(x)) at temperature T,
   and P(argmax q == argmax p) for greedy. This is the expectation of spec/accept_rate (DESIGN.md).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from rollout_ssd.models.decoder import Decoder
from rollout_ssd.runner import ModelRunner
from rollout_ssd.sampling import draw_tokens, sequence_generator, target_probs

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------- 1. prompts
_NAMES = ["Tom", "Maria", "Aisha", "Kenji", "Liam", "Sofia", "Omar", "Mei", "Noah", "Priya", "Lucas", "Zara",
          "Ivan", "Chloe", "Mateo", "Hana", "Ben", "Fatima", "Leo", "Nina"]
_ITEMS = ["apples", "pencils", "marbles", "books", "stickers", "cookies", "coins", "cards", "flowers", "eggs",
          "oranges", "toy cars", "shells", "balloons", "cupcakes", "stamps"]
_TOPICS = ["photosynthesis", "the water cycle", "black holes", "the French Revolution", "machine learning",
           "climate change", "the human heart", "volcanoes", "the stock market", "vaccines", "electricity",
           "the Roman Empire", "DNA", "gravity", "the internet", "recycling", "honey bees", "the moon",
           "inflation", "sleep", "rainbows", "earthquakes", "democracy", "chess", "coffee", "glaciers",
           "the immune system", "solar panels", "bread baking", "music theory", "the printing press",
           "ocean tides", "friendship", "time management", "public speaking", "exercise", "dinosaurs"]
_THINGS = ["a cat", "a robot", "a lighthouse keeper", "a young wizard", "a lost dog", "an astronaut",
           "a baker", "a dragon", "a detective", "a tree", "a little girl", "an old fisherman", "a pirate",
           "a teacher", "a talking car", "a penguin"]
_CODE_TASKS = ["reverses a string", "checks whether a number is prime", "sorts a list of numbers",
               "counts the vowels in a sentence", "computes the factorial of n", "finds the largest element "
               "in a list", "converts Celsius to Fahrenheit", "checks if a word is a palindrome",
               "sums the digits of an integer", "returns the Fibonacci numbers up to n",
               "removes duplicates from a list", "counts word frequencies in a text"]
_LANGS = ["Python", "JavaScript", "C", "Java", "Rust", "Go"]

# Templates per kind; the LAST template of each kind is held out (never used for training prompts).
_TEMPLATES = {
    "question": ["What is {topic}?", "Why is {topic} important?", "How does {topic} work?",
                 "What are the main facts about {topic}?", "Can you tell me something surprising about {topic}?"],
    "explain": ["Explain {topic} in simple terms.", "Explain {topic} to a ten-year-old.",
                "Give a short explanation of {topic}.", "Describe {topic} in three sentences.",
                "Summarize what everyone should know about {topic}."],
    "list": ["List five facts about {topic}.", "Give me three tips related to {topic}.",
             "Name four common misconceptions about {topic}.", "List the pros and cons of {topic}.",
             "What are three questions a student might ask about {topic}?"],
    "story": ["Write a short story about {thing}.", "Tell a bedtime story about {thing}.",
              "Write a poem about {thing}.", "Write a funny story about {thing} and {thing2}.",
              "Write a short fable about {thing} that teaches a lesson."],
    "instruction": ["Write an email to a friend about {topic}.", "Write a short speech about {topic}.",
                    "Give me a step-by-step guide to learning about {topic}.",
                    "Write a tweet about {topic}.", "Write a short blog post introduction about {topic}."],
    "code": ["Write a {lang} function that {code}.", "Show me {lang} code that {code}.",
             "How do I write a program in {lang} that {code}?", "Write a short {lang} snippet that {code}.",
             "Implement a function in {lang} which {code}, and explain it."],
    "math": ["{name} has {a} {item}. {name2} gives {name} {b} more. How many {item} does {name} have now?",
             "{name} had {a} {item} and gave away {b}. How many {item} are left?",
             "There are {a} boxes with {b} {item} in each box. How many {item} are there in total?",
             "{name} shares {c} {item} equally among {d} friends. How many {item} does each friend get?",
             "{name} buys {a} {item} at {d} dollars each and pays with a {e}-dollar bill. How much change "
             "does {name} get?"],
}


@dataclass(frozen=True)
class PromptSplit:
    train: list[str]
    heldout: list[str]


def _fill(template: str, rng: random.Random) -> str:
    name, name2 = rng.sample(_NAMES, 2)
    thing, thing2 = rng.sample(_THINGS, 2)
    d = rng.randint(2, 9)
    return template.format(topic=rng.choice(_TOPICS), thing=thing, thing2=thing2, code=rng.choice(_CODE_TASKS),
                           lang=rng.choice(_LANGS), name=name, name2=name2, item=rng.choice(_ITEMS),
                           a=rng.randint(2, 60), b=rng.randint(2, 30), c=d * rng.randint(2, 12), d=d,
                           e=rng.choice([20, 50, 100]))


def build_prompts(num_train: int, num_heldout: int, seed: int = 0) -> PromptSplit:
    """Varied instruction prompts, kinds in rotation (questions, explanations, lists, stories,
    instructions, code, arithmetic word problems). Held-out prompts use each kind's last template,
    which training never uses, and a different seed; duplicates are removed."""
    def make(count: int, held: bool, rng: random.Random) -> list[str]:
        out: list[str] = []
        seen: set[str] = set()
        kinds = list(_TEMPLATES)
        attempts = 0
        while len(out) < count and attempts < 50 * count + 100:
            kind = kinds[attempts % len(kinds)]
            attempts += 1
            templates = _TEMPLATES[kind]
            template = templates[-1] if held else rng.choice(templates[:-1])
            text = _fill(template, rng)
            if text not in seen:
                seen.add(text)
                out.append(text)
        return out

    return PromptSplit(train=make(num_train, False, random.Random(seed)),
                       heldout=make(num_heldout, True, random.Random(seed + 1_000_003)))


def chat_prompt_ids(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text as a single user turn with the generation prompt (engine's chat=True)."""
    out = []
    for text in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


# ------------------------------------------------------------------------- 2. on-policy data
@dataclass
class TeacherSample:
    """prompt + completion token ids, and the teacher's top-k log-probs (full-vocabulary log-softmax,
    T = 1) for each completion token: row j is the distribution token_ids[prompt_len + j] was drawn from."""

    token_ids: list[int]
    prompt_len: int
    topk_ids: torch.Tensor      # [n, k] int32
    topk_logp: torch.Tensor     # [n, k] float16

    @property
    def num_completion(self) -> int:
        return len(self.token_ids) - self.prompt_len


@torch.no_grad()
def save_samples(path, samples: Sequence[TeacherSample], next_prompt: int) -> None:
    """A data cache of plain lists, ints and tensors (loadable with torch.load(weights_only=True))."""
    torch.save({"format": "teacher-samples-v1", "next_prompt": int(next_prompt),
                "token_ids": [list(s.token_ids) for s in samples], "prompt_len": [int(s.prompt_len) for s in samples],
                "topk_ids": [s.topk_ids for s in samples], "topk_logp": [s.topk_logp for s in samples]}, path)


def load_samples(path) -> tuple[list[TeacherSample], int]:
    """(samples, next_prompt) from `save_samples`'s file, unpickling nothing but tensors and plain data."""
    data = torch.load(path, weights_only=True)
    if not isinstance(data, dict) or data.get("format") != "teacher-samples-v1":
        raise ValueError(f"{path}: not a teacher-samples-v1 data cache")
    fields = zip(data["token_ids"], data["prompt_len"], data["topk_ids"], data["topk_logp"])
    return [TeacherSample(list(t), int(p), ids, logp) for t, p, ids, logp in fields], int(data["next_prompt"])


def decode_lockstep(models: Sequence[Decoder], prompt_ids: Sequence[Sequence[int]], temperatures: Sequence[float],
                    max_new_tokens: int, eos_ids: Sequence[int], batch_size: int = 32, seed: int = 0,
                    on_step: Optional[Callable[[list[int], list[int], list[torch.Tensor]], None]] = None,
                    deadline: Optional[float] = None) -> list[list[int]]:
    """Sample a completion per prompt from models[0] (the engine's law: `target_probs` + `draw_tokens`,
    generator per (seed, prompt index)); every model in `models` runs the same tokens in lockstep.
    on_step(prompt_indices, positions_in_completion, [logits [B, V] per model]) sees every step.
    After `deadline` (time.monotonic()) no new prompt starts and running ones stop where they are.
    Returns the completions (prompts never started get an empty list)."""
    max_prompt = max(len(p) for p in prompt_ids)
    runners = [ModelRunner(m, batch_size, max_prompt + max_new_tokens + 1) for m in models]
    eos = set(eos_ids)
    completions: list[list[int]] = [[] for _ in prompt_ids]
    gens = [sequence_generator(seed, i, 0) for i in range(len(prompt_ids))]
    waiting = list(range(len(prompt_ids)))[::-1]
    running: dict[int, int] = {}  # prompt index -> slot

    def advance(rows: list[int], logits: list[torch.Tensor]) -> None:
        if on_step is not None:
            on_step(rows, [len(completions[i]) for i in rows], logits)
        temp = torch.tensor([float(temperatures[i]) for i in rows])
        probs = target_probs(logits[0], temp, torch.zeros(len(rows), dtype=torch.long), torch.ones(len(rows)))
        tokens = draw_tokens(probs, temp <= 0, [gens[i] for i in rows]).tolist()
        for i, t in zip(rows, tokens):
            completions[i].append(t)
            if t in eos or len(completions[i]) >= max_new_tokens:
                for r in runners:
                    r.free(running[i])
                del running[i]

    while waiting or running:
        late = deadline is not None and time.monotonic() > deadline
        if late:
            waiting.clear()
        admitted = []
        while waiting and len(running) < batch_size:
            i = waiting.pop()
            slots = {r.allocate() for r in runners}
            assert len(slots) == 1, "lockstep runners allocate the same slot"
            running[i] = slots.pop()
            admitted.append(i)
        if admitted:
            logits = [r.prefill([running[i] for i in admitted], [prompt_ids[i] for i in admitted]) for r in runners]
            advance(admitted, logits)
        rows = [i for i in running if i not in admitted]
        if late:
            for i in rows:
                for r in runners:
                    r.free(running[i])
                del running[i]
            continue
        if rows:
            logits = [r.decode([running[i] for i in rows], [completions[i][-1] for i in rows]) for r in runners]
            advance(rows, logits)
    return completions


def _topk_logp(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = logits.float().topk(k, dim=-1)
    return ids.to(torch.int32), (values - torch.logsumexp(logits.float(), dim=-1, keepdim=True)).half()


def sample_with_teacher(target: Decoder, prompt_ids: Sequence[Sequence[int]], temperatures: Sequence[float],
                        max_new_tokens: int, top_k: int = 64, batch_size: int = 32, seed: int = 0,
                        deadline: Optional[float] = None) -> list[TeacherSample]:
    """On-policy completions from `target` with the teacher's top-k log-probs recorded while sampling.
    Prompts cut off by the deadline before their first token are left out."""
    records: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {i: [] for i in range(len(prompt_ids))}

    def keep(rows, _positions, logits):
        ids, logp = _topk_logp(logits[0], top_k)
        for j, i in enumerate(rows):
            records[i].append((ids[j], logp[j]))

    completions = decode_lockstep([target], prompt_ids, temperatures, max_new_tokens, target.cfg.eos_token_ids,
                                  batch_size, seed, keep, deadline)
    out = []
    for i, comp in enumerate(completions):
        if comp:
            rec = records[i][:len(comp)]
            out.append(TeacherSample(list(prompt_ids[i]) + comp, len(prompt_ids[i]),
                                     torch.stack([r[0] for r in rec]), torch.stack([r[1] for r in rec])))
    return out


@torch.no_grad()
def teacher_topk(target: Decoder, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                 top_k: int = 64) -> list[TeacherSample]:
    """The teacher's top-k log-probs over the completion part of existing sequences (one
    `forward_train` per sequence; for rollouts made elsewhere, e.g. by the engine in RL)."""
    out = []
    for seq, plen in zip(sequences, prompt_lens):
        if len(seq) <= plen or plen < 1:
            continue
        hidden = target.forward_train(torch.tensor([list(seq[:-1])]))[0, plen - 1:]
        ids, logp = _topk_logp(target.logits(hidden), top_k)
        out.append(TeacherSample(list(seq), plen, ids, logp))
    return out


# ------------------------------------------------------------------------------- 3. the draft
def select_head_tokens(samples: Sequence[TeacherSample], size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The `size` most frequent completion tokens (plus `always`, e.g. EOS), sorted ids [size]."""
    counts = torch.zeros(max(max(s.token_ids) for s in samples) + 1, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(torch.tensor(s.token_ids[s.prompt_len:]), minlength=len(counts))
    for t in always:
        if t < len(counts):
            counts[t] = counts.max() + 1
    order = counts.argsort(descending=True, stable=True)
    return order[:size].sort().values


def coverage(head_token_ids: torch.Tensor, samples: Sequence[TeacherSample]) -> float:
    """Share of completion tokens the head can produce."""
    head = set(head_token_ids.tolist())
    toks = [t for s in samples for t in s.token_ids[s.prompt_len:]]
    return sum(t in head for t in toks) / max(len(toks), 1)


def draft_hf_config(target_hf_config, num_layers: int, head_size: int) -> dict:
    """The draft's config.json: the target's (rope, norms, heads, ...) with fewer layers, a restricted
    head and a shared embedding. Quantization entries of a GGUF source are dropped."""
    cfg = target_hf_config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version", "architectures", "dtype",
                "torch_dtype"):
        cfg.pop(key, None)
    cfg.update(model_type="llama" if cfg.get("model_type") == "llama" else cfg["model_type"],
               architectures=["LlamaForCausalLM"] if cfg.get("model_type") == "llama" else None,
               num_hidden_layers=num_layers, head_vocab_size=int(head_size), shares_target_embedding=True,
               tie_word_embeddings=False, dtype="bfloat16")
    return {k: v for k, v in cfg.items() if v is not None}


def make_draft(target: Decoder, head_token_ids: torch.Tensor, num_layers: int = 2) -> Decoder:
    """A float32 draft: target layers 0..num_layers-1 and final norm, the target's embedding shared
    (frozen), LM head = the target's output rows of `head_token_ids`. Trainable parameters have
    requires_grad=True (everything but the embedding)."""
    cfg = replace(target.cfg, num_layers=num_layers, head_vocab_size=len(head_token_ids),
                  shares_target_embedding=True, tie_word_embeddings=False)
    draft = Decoder(cfg, target.inv_freq.clone(), target.rope_scaling, dtype=torch.float32)
    src = target.hf_parameters()
    state = {name: src[name] for name in draft.hf_parameters() if name in src and not name.startswith("lm_head")}
    full_head = target.lm_head
    state["lm_head.weight"] = full_head[head_token_ids]
    state["lm_head.token_ids"] = head_token_ids
    with torch.no_grad():
        params = draft.hf_parameters()
        draft.embed = (target.embed if target.embed.dtype == torch.float32 else
                       nn.Parameter(target.embed.detach().float(), requires_grad=False))
        for name, tensor in state.items():
            if name != "model.embed_tokens.weight":
                params[name].copy_(tensor)
    for p in trainable_parameters(draft):
        p.requires_grad_(True)
    return draft


def trainable_parameters(draft: Decoder) -> list[nn.Parameter]:
    return [p for name, p in draft.named_parameters() if name not in ("embed", "head_token_ids")]


def round_weights(draft: Decoder, dtype: torch.dtype = torch.bfloat16) -> None:
    """Round trainable weights to `dtype` in place (kept in float32): the draft then computes exactly
    what the checkpoint saved in `dtype` computes after loading in float32."""
    with torch.no_grad():
        for p in trainable_parameters(draft):
            p.copy_(p.to(dtype).float())


def save_draft(draft: Decoder, hf_config: dict, path, dtype: torch.dtype = torch.bfloat16,
               max_bytes: Optional[int] = 25_000_000) -> int:
    """config.json + model.safetensors (weights in `dtype`, no embedding). Returns the file size."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, t in draft.hf_parameters().items():
        if name == "model.embed_tokens.weight":
            continue
        state[name] = t.detach().clone().contiguous() if name == "lm_head.token_ids" else t.detach().to(dtype).contiguous()
    file = path / "model.safetensors"
    save_file(state, str(file), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    size = file.stat().st_size
    if max_bytes is not None and size > max_bytes:
        raise ValueError(f"draft checkpoint is {size} bytes, over the {max_bytes}-byte limit")
    return size


# -------------------------------------------------------------------------------- 4. training
@dataclass(frozen=True)
class DistillConfig:
    lr: float = 5e-4
    min_lr_ratio: float = 0.05
    warmup_steps: int = 20
    weight_decay: float = 0.0
    batch_tokens: int = 4096   # completion positions per step (about)
    minutes: float = 10.0      # wall-clock budget; the cosine schedule follows elapsed time
    max_steps: Optional[int] = None
    grad_clip: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.lr <= 0 or self.batch_tokens < 1 or self.minutes <= 0:
            raise ValueError("DistillConfig: lr, batch_tokens and minutes must be positive")


@dataclass
class Batch:
    tokens: torch.Tensor     # [B, T] inputs (right-padded)
    rows: torch.Tensor       # [N] batch row of each supervised position
    cols: torch.Tensor       # [N] input position whose hidden state predicts it
    teacher_ids: torch.Tensor   # [N, k] int64
    teacher_logp: torch.Tensor  # [N, k] float32


def make_batch(samples: Sequence[TeacherSample]) -> Batch:
    t_max = max(len(s.token_ids) - 1 for s in samples)
    tokens = torch.zeros(len(samples), t_max, dtype=torch.long)
    rows, cols = [], []
    for b, s in enumerate(samples):
        tokens[b, :len(s.token_ids) - 1] = torch.tensor(s.token_ids[:-1])
        n = s.num_completion
        rows.append(torch.full((n,), b))
        cols.append(torch.arange(s.prompt_len - 1, s.prompt_len - 1 + n))
    return Batch(tokens, torch.cat(rows), torch.cat(cols), torch.cat([s.topk_ids for s in samples]).long(),
                 torch.cat([s.topk_logp for s in samples]).float())


def head_index(draft: Decoder) -> torch.Tensor:
    """vocabulary id -> row of the restricted head, -1 where the head lacks the token. [V]"""
    index = torch.full((draft.cfg.vocab_size,), -1, dtype=torch.long)
    index[draft.head_token_ids] = torch.arange(len(draft.head_token_ids))
    return index


def distill_loss(draft: Decoder, batch: Batch, index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean over positions of KL(p || q): p = teacher top-k restricted to the head, renormalised;
    q = the draft's softmax over its head."""
    index = head_index(draft) if index is None else index
    hidden = draft.forward_train(batch.tokens)[batch.rows, batch.cols]      # [N, H]
    logq = torch.log_softmax(F.linear(hidden, draft.lm_head).float(), -1)   # [N, head]
    cols = index[batch.teacher_ids]                                        # [N, k]
    valid = cols >= 0
    logp = batch.teacher_logp.masked_fill(~valid, float("-inf"))
    logp = logp - torch.logsumexp(logp, -1, keepdim=True)                   # renormalise on the support
    p = logp.exp()
    logq_k = logq.gather(1, cols.clamp(min=0))
    kl = (p * (logp.masked_fill(~valid, 0.0) - logq_k)).masked_fill(~valid, 0.0).sum(-1)
    return kl[valid.any(-1)].mean()


@dataclass
class TrainStats:
    steps: int
    seconds: float
    positions_seen: int
    first_loss: float
    last_loss: float   # mean of the last 20 steps


def _batches(samples: Sequence[TeacherSample], batch_tokens: int, rng: random.Random):
    """Endless epochs of length-bucketed batches holding about batch_tokens completion positions."""
    while True:
        order = sorted(range(len(samples)), key=lambda i: (len(samples[i].token_ids), rng.random()))
        groups, cur, n = [], [], 0
        for i in order:
            cur.append(i)
            n += samples[i].num_completion
            if n >= batch_tokens:
                groups.append(cur)
                cur, n = [], 0
        if cur:
            groups.append(cur)
        rng.shuffle(groups)
        for g in groups:
            yield make_batch([samples[i] for i in g])


def train_draft(draft: Decoder, samples: Sequence[TeacherSample], config: DistillConfig,
                log_every: int = 10, on_log: Optional[Callable[[dict], None]] = None) -> TrainStats:
    """AdamW on distill_loss until config.minutes (or max_steps) run out."""
    params = trainable_parameters(draft)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.98))
    index = head_index(draft)
    rng = random.Random(config.seed)
    budget = config.minutes * 60.0
    start = time.monotonic()
    losses: list[float] = []
    seen = step = 0
    for batch in _batches(samples, config.batch_tokens, rng):
        elapsed = time.monotonic() - start
        if elapsed >= budget or (config.max_steps is not None and step >= config.max_steps):
            break
        frac = elapsed / budget if config.max_steps is None else step / config.max_steps
        cosine = config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        lr = config.lr * min(1.0, (step + 1) / config.warmup_steps) * cosine
        for g in opt.param_groups:
            g["lr"] = lr
        loss = distill_loss(draft, batch, index)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if config.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        opt.step()
        step += 1
        seen += len(batch.rows)
        losses.append(float(loss.detach()))
        if on_log is not None and (step % log_every == 0 or step == 1):
            on_log({"step": step, "loss": sum(losses[-log_every:]) / len(losses[-log_every:]), "lr": lr,
                    "positions": seen, "seconds": time.monotonic() - start})
    for p in params:
        p.requires_grad_(False)
        p.grad = None
    tail = losses[-20:] or [float("nan")]
    return TrainStats(step, time.monotonic() - start, seen, losses[0] if losses else float("nan"),
                      sum(tail) / len(tail))


@torch.no_grad()
def eval_kl(draft: Decoder, samples: Sequence[TeacherSample]) -> float:
    """distill_loss averaged over `samples` (e.g. held-out ones)."""
    index = head_index(draft)
    total = count = 0.0
    for start in range(0, len(samples), 8):
        batch = make_batch(samples[start:start + 8])
        total += float(distill_loss(draft, batch, index)) * len(batch.rows)
        count += len(batch.rows)
    return total / max(count, 1)


# ------------------------------------------------------------------------- 5. measurement
@dataclass
class Acceptance:
    temperature: float
    accept_rate: float   # mean expected per-token acceptance along the continuations
    positions: int
    sequences: int


def measure_acceptance(target: Decoder, draft: Decoder, prompt_ids: Sequence[Sequence[int]], temperature: float,
                       max_new_tokens: int = 128, batch_size: int = 16, seed: int = 1234) -> Acceptance:
    """Expected SD acceptance per draft token along continuations the target samples at `temperature`:
    T > 0: sum_x min(p_T(x), q_T(x)) (the probability min(1, p/q) accepts a draft token drawn from q_T);
    T = 0: 1[argmax q == argmax p]. Target and draft run in lockstep through our runner."""
    total, count = 0.0, 0

    def score(_rows, _positions, logits):
        nonlocal total, count
        p_logits, q_logits = logits
        if temperature <= 0:
            hits = (p_logits.argmax(-1) == q_logits.argmax(-1)).float()
        else:
            p = torch.softmax(p_logits.float() / temperature, -1)
            q = torch.softmax(q_logits.float() / temperature, -1)
            hits = torch.minimum(p, q).sum(-1)
        total += float(hits.sum())
        count += len(hits)

    eos = target.cfg.eos_token_ids
    completions = decode_lockstep([target, draft], prompt_ids, [temperature] * len(prompt_ids), max_new_tokens,
                                  eos, batch_size, seed, score)
    return Acceptance(temperature, total / max(count, 1), count, sum(1 for c in completions if c))


@torch.no_grad()
def measure_cost(target: Decoder, draft: Decoder, batch_sizes: Sequence[int] = (1, 8), context: int = 128,
                 steps: int = 30) -> dict[int, dict[str, float]]:
    """Seconds per decode step of target and draft at each batch size (`context` tokens already cached),
    median over `steps` steps after a warm-up, and the ratio draft / target. Target and draft steps
    alternate, so load from other processes hits both alike."""
    out = {}
    for b in batch_sizes:
        runners = {}
        for name, model in (("target", target), ("draft", draft)):
            runner = ModelRunner(model, b, context + steps + 8)
            slots = [runner.allocate() for _ in range(b)]
            runner.prefill(slots, [[1] * context for _ in range(b)])
            runners[name] = (runner, slots)
        times: dict[str, list[float]] = {"target": [], "draft": []}
        for i in range(steps + 3):
            for name, (runner, slots) in runners.items():
                t0 = time.perf_counter()
                runner.decode(slots, [7 + i] * b)
                if i >= 3:
                    times[name].append(time.perf_counter() - t0)
        med = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
        out[b] = {"target_s": med["target"], "draft_s": med["draft"], "ratio": med["draft"] / med["target"]}
    return out
