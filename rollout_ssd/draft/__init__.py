"""The draft's life: made from its target by distillation, kept close to the policy in RL, watched for drift.

Making a draft (recipes/distill_draft.py wires these in order):
- prompts.py: procedural training and held-out prompts (no downloads);
- on_policy.py: the target samples completions through the engine's own loop, and the teacher's
  top-k log-probs are kept from the very logits it sampled from (teacher.py: the data and its cache);
- build.py: the draft itself, the target's first L layers with a restricted LM head and the target's
  embedding shared;
- loss.py, train.py: forward KL(p || q) at every completion position, AdamW under a time budget;
- acceptance.py: held-out expected SD acceptance and the decode-step cost ratio;
- checkpoint.py: the checkpoint on disk, with its size limit checked before training starts.

In RL (rollout_ssd/rl): follow.py distills the draft toward the current policy every N steps, and
drift.py measures KL(target || draft) and the rollout-vs-learner logprob mismatch per version.
"""
