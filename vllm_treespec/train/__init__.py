"""EAGLE-3 drafter distillation for Llama-architecture targets.

Pipeline (each stage resumable, all under one work directory):

1. ``prompts``   – a seeded corpus of training prompts built on the machine
                   (templated instructions, code stubs from installed docstrings,
                   queries the target writes itself, multi-turn follow-ups).
2. ``generate``  – the target answers them through vLLM (greedy and sampled);
                   the three auxiliary hidden states vLLM's Eagle3 reads and the
                   final hidden state are captured during generation.
3. ``vocab``     – the draft vocabulary (``d2t``/``t2d``) by token frequency.
4. ``train``     – training-time-test distillation of the one-layer drafter.
5. ``export``    – a checkpoint that vLLM's ``eagle3`` method loads.
"""
