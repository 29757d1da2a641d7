"""The vLLM definitions a Model Runner V2 (MRV2) adapter for ``eagle3_tree`` would call
or override (docs/mrv2.md, sections 1, 3 and 5), with what each supported-or-next
release defines: the table ``mrv2_api`` checks a vLLM source tree against.

A row names a file (under ``vllm/``), a definition (``func``, ``Class`` or
``Class.method``) and what to read there:

- ``params``: the definition's parameter names (``self``/``cls`` left out; ``*``,
  ``*args``, ``**kwargs`` and ``/`` as Python writes them);
- ``bases``: the class's bases as written;
- ``fields``, ``methods``, ``mentions``: which of ``probe`` the class assigns at class
  level, the class defines as methods, or the definition's body names.

An expectation of ``None`` means the definition (or its file) is absent in that release.
"""

from __future__ import annotations

from dataclasses import dataclass, field

RELEASES = ("0.32.0", "0.34.0")
KINDS = ("params", "bases", "fields", "methods", "mentions")
SAME = object()  # the 0.34.0 expectation equals 0.32.0's


@dataclass(frozen=True)
class Row:
    file: str
    name: str
    kind: str
    expected: dict = field(hash=False)  # release -> tuple of names, or None (absent)
    use: str = ""
    probe: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        return f"{self.file}::{self.name}"


def _row(kind, file, name, old, new=SAME, use="", probe=()):
    old = None if old is None else tuple(old)
    new = old if new is SAME else (None if new is None else tuple(new))
    return Row(file, name, kind, {"0.32.0": old, "0.34.0": new}, use, tuple(probe))


W = "v1/worker/gpu/"
SD = W + "spec_decode/"
TDAR = SD + "target_dependent_ar/speculator.py"
MR = W + "model_runner.py"
SC = SD + "speculator_config.py"
EC = SD + "eagle/config.py"

PROPOSE = ("input_batch", "attn_metadata", "slot_mappings", "last_hidden_states",
           "aux_hidden_states", "num_sampled", "num_rejected", "last_sampled",
           "next_prefill_tokens", "temperature", "seeds", "dp_sync_state", "dummy_run",
           "skip_attn_for_dummy_run", "mm_inputs", "is_profile", "num_speculative_tokens")
PREFILL = ("num_reqs", "num_tokens", "attn_metadata", "slot_mappings", "num_tokens_across_dp",
           "cudagraph_runtime_mode", "mm_inputs")
PREPARE_ATTN = ("input_batch", "cudagraph_mode", "block_tables", "slot_mappings", "attn_groups",
                "kv_cache_config", "for_capture", "ubatch_idx")
POST_UPDATE = ("idx_mapping", "num_computed_tokens", "last_sampled_tokens", "output_bin_counts",
               "sampled_tokens", "num_sampled", "num_rejected", "query_start_loc",
               "all_token_ids", "total_len")
POSTPROCESS = ("idx_mapping", "sampled_tokens", "num_sampled", "num_rejected", "query_start_loc")
KV_CACHE = ("kv_cache_config", "is_profiling", "kv_cache_allocation_context")
INIT_KV = ("forward_context", "kv_cache_config", "device", "kernel_block_sizes", "vllm_config",
           "kv_cache_allocation_context", "*", "block_tables", "attn_groups")
EXECUTE = ("scheduler_output", "intermediate_tensors", "dummy_run", "skip_attn_for_dummy_run",
           "is_profile", "context_len", "valid_dummy_state_slots", "randomize_inputs")
SCHEDULER = ("vllm_config", "kv_cache_config", "structured_output_manager", "block_size",
             "hash_block_size", "mm_registry", "include_finished_set", "log_stats")
EAGLE_FIELDS = ("base_method", "speculator_class", "supported_options", "supports_watermarking")
POST_INIT = ("get_custom_speculator_config_class", "custom_method", "base_method",
             "_METHOD_SPECIFIC_OPTIONS", "supported_options", "apply_options")
SAMPLE_DRAFT = ("hidden_states", "sample_src_positions", "idx_mapping", "temperature", "seeds",
                "draft_step", "draft_logits", "spec_step_idx")
PREFILL_READS = ("sample_draft", "last_token_indices", "hidden_states", "input_buffers")
OVERRIDE_SPEC = ("model", "tokenizer", "trust_remote_code", "revision",
                 "vllm_speculative_config", "hf_token", "**kwargs")

ROWS: tuple[Row, ...] = (
    # Registration and configuration (section 2).
    _row("params", SC, "register_speculative_method", None,
         ("name", "config_cls"), "the method's name"),
    _row("fields", SC, "SpeculatorConfig", None,
         ("base_method", "speculator_class", "supported_options"), "config class",
         probe=("base_method", "speculator_class", "supported_options")),
    _row("methods", SC, "SpeculatorConfig", None,
         ("apply_options", "num_lookahead_tokens", "hash_factors"), "tree options",
         probe=("apply_options", "num_lookahead_tokens", "hash_factors")),
    _row("bases", EC, "Eagle3SpeculatorConfig", None,
         ("EagleSpeculatorConfig",), "our config's base"),
    _row("fields", "config/speculative.py", "SpeculativeConfig", ("method",),
         ("method", "custom_method", "speculator_options"), "tree options",
         probe=("method", "custom_method", "speculator_options")),
    _row("params", "config/vllm.py", "VllmConfig._get_v2_model_runner_unsupported_features",
         (), None, "keeps V1 on 0.32.0"),
    _row("params", SD + "__init__.py", "init_speculator", ("vllm_config", "device", "req_states"),
         use="builds the speculator"),
    _row("mentions", SD + "__init__.py", "init_speculator", ("use_eagle",),
         ("speculator_class", "resolve_obj_by_qualname"), "builds the speculator",
         probe=("use_eagle", "speculator_class", "resolve_obj_by_qualname")),
    # What eagle3_tree's registration uses (docs/mrv2.md, "On vLLM 0.34"):
    # mrv2/registration.py, mrv2/method_config.py, speculator.RegisteredTreeSpeculator.
    _row("params", SC, "get_custom_speculator_config_class", None, ("method",),
         "registered config by name"),
    _row("mentions", SC, "get_custom_speculator_config_class", None,
         ("resolve_obj_by_qualname", "issubclass", "speculator_class"),
         "registered config by name",
         probe=("resolve_obj_by_qualname", "issubclass", "speculator_class")),
    _row("fields", SC, "SpeculatorConfig", None, ("supports_watermarking",),
         "no watermarking", probe=("supports_watermarking",)),
    _row("fields", EC, "EagleSpeculatorConfig", None, EAGLE_FIELDS, "what our config sets",
         probe=EAGLE_FIELDS),
    _row("params", EC, "EagleSpeculatorConfig.apply_options", None, ("spec",),
         "tree options (ours calls it)"),
    _row("methods", EC, "EagleSpeculatorConfig", None,
         ("apply_options", "num_lookahead_tokens", "adapt_draft_model_config"),
         "EAGLE setup, inherited",
         probe=("apply_options", "num_lookahead_tokens", "adapt_draft_model_config")),
    _row("fields", EC, "Eagle3SpeculatorConfig", None, ("base_method",), "method = eagle3",
         probe=("base_method",)),
    _row("methods", EC, "Eagle3SpeculatorConfig", None, ("uses_aux_hidden_states",),
         "aux hidden states, inherited", probe=("uses_aux_hidden_states",)),
    _row("mentions", "config/speculative.py", "SpeculativeConfig.__post_init__", (),
         POST_INIT, "custom method, options gate", probe=POST_INIT),
    _row("mentions", SD + "__init__.py", "init_speculator", ("req_states",),
         ("signature", "req_states"), "our constructor's arguments",
         probe=("signature", "req_states")),
    _row("params", SD + "speculator.py", "DraftModelSpeculator.__init__",
         ("vllm_config", "device"), use="our constructor's arguments"),
    _row("params", SD + "speculator.py", "DraftModelSpeculator.sample_draft", SAMPLE_DRAFT,
         SAMPLE_DRAFT + ("num_steps",), "the roots' log-probabilities"),
    _row("mentions", TDAR, "TargetDependentARSpeculator._prefill", PREFILL_READS,
         use="the roots, left in its buffers", probe=PREFILL_READS),
    _row("mentions", MR, "GPUModelRunner.__init__", ("init_speculator",),
         use="built before our runner adopts it", probe=("init_speculator",)),
    # The speculator (sections 1 and 3).
    _row("params", SD + "speculator.py", "BaseSpeculator.propose", PROPOSE, use="drafting"),
    _row("params", SD + "speculator.py", "BaseSpeculator.add_request", None, ("req_index",),
         "per-request tree state"),
    _row("params", SD + "speculator.py", "BaseSpeculator.on_requests_finished", None,
         ("finished_req_ids",), "per-request tree state"),
    _row("params", SD + "speculator.py", "BaseSpeculator.reset_state", None, (),
         "per-request tree state"),
    _row("params", SD + "speculator.py", "DraftModelSpeculator.prepare_propose", None,
         ("input_batch", "num_sampled", "num_rejected", "sampler"), "accepted path to the front"),
    _row("params", SD + "speculator.py", "DraftModelSpeculator.set_attn",
         ("model_state", "kv_cache_config", "block_tables", "target_input_buffers",
          "target_attn_groups"), use="the target's ModelState"),
    _row("params", SD + "speculator.py", "DraftModelSpeculator.load_model", ("target_model",),
         use="head checks"),
    _row("params", SD + "speculator.py", "DraftModelSpeculator._build_uniform_attn_metadata",
         ("batch_desc", "num_reqs", "num_query_per_req", "seq_lens_cpu_upper_bound", "step",
          "causal", "dcp_local_seq_lens"), use="draft levels"),
    _row("bases", SD + "eagle/speculator.py", "EagleSpeculator", ("TargetDependentARSpeculator",),
         use="our speculator's base"),
    _row("bases", TDAR, "TargetDependentARSpeculator", ("DraftModelSpeculator",),
         ("AutoRegressiveSpeculator",), "our speculator's base"),
    _row("params", TDAR, "TargetDependentARSpeculator.propose", PROPOSE, use="drafting"),
    _row("params", TDAR, "TargetDependentARSpeculator._prefill", PREFILL,
         PREFILL + ("skip_sample",), "vLLM's first draft pass"),
    _row("params", TDAR, "TargetDependentARSpeculator._run_model", PREFILL[1:],
         use="draft levels"),
    _row("methods", TDAR, "TargetDependentARSpeculator", ("_multi_step_decode",), ("_decode",),
         "stock decode steps", probe=("_multi_step_decode", "_decode")),
    _row("methods", SD + "autoregressive/speculator.py", "AutoRegressiveSpeculator", None,
         ("_decode", "_multi_step_decode"), "stock decode steps",
         probe=("_decode", "_multi_step_decode")),
    # Verification (section 3).
    _row("params", SD + "rejection_sampler.py", "RejectionSampler.__call__",
         ("logits", "input_batch", "draft_logits", "invalid_drafts"),
         ("logits", "input_batch", "draft_logits"), "plain rows' sampling"),
    _row("params", W + "model_states/interface.py", "ModelState.custom_sampler", ("sampler",),
         use="tree acceptance"),
    _row("params", W + "model_states/interface.py", "ModelState.prepare_inputs",
         ("input_batch", "req_states"), use="tree positions"),
    _row("params", W + "model_states/interface.py", "ModelState.prepare_attn", PREPARE_ATTN,
         use="tree mask"),
    _row("params", W + "model_states/default.py", "DefaultModelState.prepare_attn",
         PREPARE_ATTN + ("model_specific_attn_metadata",), use="tree mask"),
    _row("params", W + "model_states/__init__.py", "resolve_model_state_cls",
         ("vllm_config", "model"), use="the model picks the state"),
    _row("params", W + "input_batch.py", "combine_sampled_and_draft_tokens",
         ("input_ids", "idx_mapping", "last_sampled_tokens", "query_start_loc", "seq_lens",
          "prefill_len", "draft_tokens", "cu_num_logits", "num_logits",
          "num_new_sampled_tokens"), use="verify rows"),
    _row("params", W + "input_batch.py", "post_update", POST_UPDATE,
         POST_UPDATE + ("draft_tokens", "draft_tokens_out"), "commit"),
    _row("params", W + "attn_utils.py", "build_attn_metadata",
         ("attn_groups", "num_reqs", "num_tokens", "query_start_loc_gpu", "query_start_loc_cpu",
          "max_query_len", "seq_lens", "max_seq_len", "block_tables", "slot_mappings",
          "kv_cache_config", "seq_lens_cpu_upper_bound", "dcp_local_seq_lens",
          "dcp_local_seq_lens_cpu_upper_bound", "positions", "is_prefilling",
          "mm_req_doc_ranges", "model_specific_attn_metadata", "for_cudagraph_capture",
          "causal", "rswa_prefix_lens", "ubatch_idx", "fast_prefill", "req_idx"),
         use="tree mask"),
    _row("params", W + "attn_utils.py", "init_kv_cache", INIT_KV, INIT_KV + ("allocate",),
         "spare blocks"),
    # The runner (section 3's override table).
    _row("params", MR, "GPUModelRunner.__init__", ("vllm_config", "device"),
         use="0.32.0: our speculator"),
    _row("params", MR, "GPUModelRunner.load_model",
         ("load_dummy_weights", "*args", "model", "**kwargs"), use="state wrapper, sampler"),
    _row("params", MR, "GPUModelRunner.initialize_kv_cache", KV_CACHE, KV_CACHE + ("extensible",),
         "spare blocks, calibration"),
    _row("params", MR, "GPUModelRunner.execute_model", EXECUTE, use="frame stack, timing"),
    _row("params", MR, "GPUModelRunner.sample_tokens", ("grammar_output",), use="metrics"),
    _row("params", MR, "GPUModelRunner.postprocess_sampled", POSTPROCESS,
         POSTPROCESS + ("draft_tokens",), "commit"),
    _row("params", MR, "GPUModelRunner.finish_requests", ("scheduler_output",),
         use="0.32.0: finished requests"),
    _row("params", MR, "GPUModelRunner.take_draft_token_ids", (), use="per-request node counts"),
    _row("methods", MR, "GPUModelRunner", (), ("reset_lora_state", "profile_adaptive_verification"),
         "new methods", probe=("reset_lora_state", "profile_adaptive_verification")),
    _row("bases", "v1/worker/cpu/model_runner.py", "CPUModelRunner", ("GPUModelRunner",),
         use="our runner's base"),
    _row("methods", "v1/worker/cpu/model_runner.py", "CPUModelRunner", ("warming_up_model",),
         use="our runner's base"),
    _row("bases", "v1/worker/cpu/standalone_model_runner.py", "StandaloneCPUModelRunner", None,
         ("LoRAModelRunnerMixin",), "no speculative decoding"),
    _row("params", "v1/worker/cpu_worker.py", "CPUWorker.init_device", (), use="builds our runner"),
    _row("mentions", "v1/worker/cpu_worker.py", "CPUWorker.init_device", ("use_v2_model_runner",),
         ("StandaloneCPUModelRunner",), "builds our runner",
         probe=("use_v2_model_runner", "StandaloneCPUModelRunner")),
    # Outside the runner: the patches that stay (section 3's override table).
    _row("params", "engine/arg_utils.py", "EngineArgs.create_speculative_config",
         ("target_model_config", "target_parallel_config"), use="0.32.0: the method's name"),
    _row("mentions", "engine/arg_utils.py", "EngineArgs.create_engine_config",
         ("maybe_override_with_speculators",), use="drafter resolution",
         probe=("maybe_override_with_speculators",)),
    _row("params", "transformers_utils/config.py", "maybe_override_with_speculators",
         OVERRIDE_SPEC, use="drafter resolution"),
    _row("params", "v1/engine/input_processor.py", "InputProcessor._validate_params",
         ("params", "supported_tasks"), use="request refusals"),
    _row("params", "v1/core/sched/scheduler.py", "Scheduler.__init__", SCHEDULER,
         use="our scheduler"),
    _row("mentions", "platforms/cpu.py", "CpuPlatform.check_and_update_config",
         ("async_scheduling",), use="sync scheduling on the CPU", probe=("async_scheduling",)),
)
