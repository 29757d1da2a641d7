"""The Ascend glue's wiring on the CPU, against stub torch_npu / vllm_ascend modules.

The stubs (below) carry the names and signatures of vllm-ascend main at
commit 182b75e, the pairing docs/ascend.md names, and do nothing an NPU does. These
tests show that the glue imports, registers and hooks where vllm-ascend calls it,
and that a renamed or missing hook fails here. They are NOT evidence that the NPU
path computes anything right: that is tests/npu and ``vllm-treespec npu-check``.
"""

import inspect
import types

import numpy as np
import pytest
import torch

from vllm_treespec.config import TreeSpecConfigError
from vllm_treespec.vllm_glue.spec_config import ADDITIONAL_CONFIG_KEY
from vllm_treespec.vllm_glue.support import ALLOW_UNTESTED_ENV

NS = types.SimpleNamespace
GLUE = ("backend", "proposer", "runner", "worker")


# ---- stubs shaped like vllm-ascend 182b75e (names, signatures, return shapes) --------

def _stub_modules():
    from vllm.v1.spec_decode.eagle import EagleProposer

    state = NS(config=None, cos_sin_positions=[])

    class AscendAttentionBackend:
        accept_output_buffer = True

        @staticmethod
        def get_name():
            return "CUSTOM"

        @staticmethod
        def get_impl_cls():
            return AscendAttentionBackendImpl

        @staticmethod
        def get_builder_cls():
            return AscendAttentionMetadataBuilder

    class AscendAttentionMetadataBuilder:
        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            k = vllm_config.speculative_config.num_speculative_tokens
            assert 1 + k <= 16, "FIA TND layout's limit"
            self.decode_threshold = self.reorder_batch_threshold = 1 + k

    class AscendAttentionBackendImpl:
        def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                     sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                     kv_sharing_target_layer_name, sinks=None, **kwargs):
            self.vllm_config = state.config  # get_current_vllm_config()
            self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
            self.num_kv_heads = num_kv_heads
            self.kv_cache_dtype, self.sliding_window = kv_cache_dtype, sliding_window
            self.alibi_slopes, self.sinks = alibi_slopes, sinks
            quant = self.vllm_config.quant_config
            self.enable_c8_quant = quant is not None and getattr(quant, "enable_c8_quant", False)

        @staticmethod
        def update_graph_params(update_stream, forward_context, num_tokens, vllm_config,
                                speculative_config=None, draft_attn_metadatas=None):
            pass

        def forward_impl(self, query, key, value, kv_cache, attn_metadata, output):
            return output

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None,
                    output_scale=None, output_block_scale=None):
            return self.forward_impl(query, key, value, kv_cache, attn_metadata, output)

    class AscendC8AttentionBackendImpl(AscendAttentionBackendImpl):
        pass

    class NPUPlatform:
        device_type = "npu"

        @classmethod
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            if attn_selector_config.use_mla:
                return "vllm_ascend.attention.mla_v1.AscendMLABackend"
            return "vllm_ascend.attention.attention_v1.AscendAttentionBackend"

    class NPUModelRunner:
        def __init__(self, vllm_config, device):
            self.vllm_config, self.device = vllm_config, torch.device(device)
            self.attn_groups, self.stub_backends = [], []
            self.positions = torch.zeros(64, dtype=torch.int64)

        def profile_run(self):
            from vllm_treespec.vllm_glue.ascend import backend

            self.seen_at_profiling = sum(b.allocated_bytes() for b in backend._BUFFERS.values())

        def initialize_kv_cache(self, kv_cache_config):
            self.attn_groups = [[NS(backend=b) for b in self.stub_backends]]

        def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
            # Linear positions (num_computed + offset in the chunk), the slot mapping
            # computed from them, then (logits_indices, spec_metadata, total_tokens).
            n = int(num_scheduled_tokens.sum())
            start = int(self.input_batch.num_computed_tokens_cpu[0])
            self.positions[:n] = torch.arange(start, start + n)
            self.slot_positions = self.positions[:n].tolist()
            self.query_start_loc = NS(np=np.array([0, n], dtype=np.int32))
            drafts = scheduler_output.scheduled_spec_decode_tokens
            spec_md = NS(num_draft_tokens=[len(d) for d in drafts.values()])
            return torch.tensor([n - 1]), spec_md, n

        def stub_forward(self, num_tokens):
            # execute_model: _preprocess gives positions = self.positions[:n], then
            # update_cos_sin(positions) gathers the rotary cos/sin for the layers.
            rotary.update_cos_sin(self.positions[:num_tokens])

    class NPUWorker:
        def __init__(self, vllm_config, local_rank, rank, distributed_init_method,
                     is_driver_worker=False, **kwargs):
            self.vllm_config, self.rank = vllm_config, rank

        def init_device(self):
            self.device = torch.device("cpu")
            self.model_runner = worker_module.NPUModelRunner(self.vllm_config, self.device)

    class AscendEagleProposer(EagleProposer):
        def set_inputs_first_pass(self, target_token_ids, next_token_ids, target_positions,
                                  target_hidden_states, token_indices_to_sample, cad,
                                  num_rejected_tokens_gpu, req_scheduled_tokens=None,
                                  long_seq_metadata=None, num_prefill_reqs=0,
                                  num_decode_reqs=0):
            return 0, None, cad, None

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    worker_module = module("vllm_ascend.worker.worker", NPUWorker=NPUWorker,
                           NPUModelRunner=NPUModelRunner)
    rotary = module("vllm_ascend.ops.rotary_embedding",
                    update_cos_sin=lambda p: state.cos_sin_positions.append(p.tolist()))
    attention_v1 = module(
        "vllm_ascend.attention.attention_v1", AscendAttentionBackend=AscendAttentionBackend,
        AscendAttentionBackendImpl=AscendAttentionBackendImpl,
        AscendAttentionMetadataBuilder=AscendAttentionMetadataBuilder,
        AscendC8AttentionBackendImpl=AscendC8AttentionBackendImpl)
    modules = {
        "torch_npu": module("torch_npu", __version__="2.10.0.post4"),
        "vllm_ascend": module("vllm_ascend"),
        "vllm_ascend.ascend_forward_context": module(
            "vllm_ascend.ascend_forward_context",
            _EXTRA_CTX=NS(capturing=False, is_draft_model=False)),
        "vllm_ascend.attention": module("vllm_ascend.attention"),
        "vllm_ascend.attention.attention_v1": attention_v1,
        "vllm_ascend.attention.utils": module("vllm_ascend.attention.utils",
                                              enable_dcp=lambda: False,
                                              enable_pcp=lambda: False),
        "vllm_ascend.platform": module("vllm_ascend.platform", NPUPlatform=NPUPlatform),
        "vllm_ascend.utils": module("vllm_ascend.utils", is_310p=lambda: False,
                                    weak_ref_tensors=lambda t: t),
        "vllm_ascend.ops": module("vllm_ascend.ops"),
        "vllm_ascend.ops.rotary_embedding": rotary,
        "vllm_ascend.worker": module("vllm_ascend.worker"),
        "vllm_ascend.worker.worker": worker_module,
        "vllm_ascend.worker.model_runner_v1": module("vllm_ascend.worker.model_runner_v1",
                                                     NPUModelRunner=NPUModelRunner),
        "vllm_ascend.spec_decode": module("vllm_ascend.spec_decode"),
        "vllm_ascend.spec_decode.eagle_proposer": module(
            "vllm_ascend.spec_decode.eagle_proposer", AscendEagleProposer=AscendEagleProposer),
    }
    stubs = NS(state=state, NPUWorkerModule=worker_module, **{
        c.__name__: c for c in (AscendAttentionBackend, AscendAttentionMetadataBuilder,
                                AscendAttentionBackendImpl, AscendC8AttentionBackendImpl,
                                NPUPlatform, NPUModelRunner, NPUWorker, AscendEagleProposer)})
    return modules, stubs


@pytest.fixture
def glue(monkeypatch):
    """The Ascend glue modules, imported fresh against the stubs (and dropped after)."""
    import importlib
    import sys

    modules, stubs = _stub_modules()
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    for name in GLUE:
        monkeypatch.delitem(sys.modules, f"vllm_treespec.vllm_glue.ascend.{name}",
                            raising=False)
    # The pairing check is the pure tests' (test_support, test_ascend_checks); the
    # installed vLLM here is not the pairing's.
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    loaded = {name: importlib.import_module(f"vllm_treespec.vllm_glue.ascend.{name}")
              for name in GLUE}
    yield NS(stubs=stubs, **loaded)
    for name in GLUE:
        sys.modules.pop(f"vllm_treespec.vllm_glue.ascend.{name}", None)


def _config(block_size=128, cache_dtype="auto", quant=None, use_mla=False,
            num_speculative_tokens=3):
    tree = {"num_nodes": num_speculative_tokens, "depth": 2, "top_k": 2, "adaptive": False}
    return NS(additional_config={ADDITIONAL_CONFIG_KEY: tree},
              model_config=NS(use_mla=use_mla, dtype=torch.float32, max_model_len=512,
                              hf_config=NS(model_type="llama"), model="stub"),
              cache_config=NS(block_size=block_size, cache_dtype=cache_dtype),
              quant_config=quant, use_v2_model_runner=False,
              parallel_config=NS(prefill_context_parallel_size=1,
                                 decode_context_parallel_size=1, rank=0,
                                 tensor_parallel_size=1),
              compilation_config=NS(cudagraph_mode=None, static_forward_context={}),
              scheduler_config=NS(max_num_seqs=2, max_num_batched_tokens=64),
              speculative_config=NS(num_speculative_tokens=num_speculative_tokens))


def _impl(glue, config=None, **change):
    glue.stubs.state.config = config or _config()
    args = dict(num_heads=4, head_size=16, scale=0.25, num_kv_heads=2, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
                attn_type="decoder", kv_sharing_target_layer_name=None)
    return glue.backend.TreeAscendAttentionImpl(**{**args, **change})


def _seat_request(runner, prefix, drafts, parents):
    from vllm_treespec.tree.proposed import ProposedTree

    tree = ProposedTree(tokens=drafts, parents=parents, probs=[0.5] * len(drafts))
    runner.scheduler_output = NS(scheduled_spec_decode_tokens={"r0": drafts})
    runner.input_batch = NS(num_reqs=1, req_ids=["r0"], req_id_to_index={"r0": 0},
                            num_computed_tokens_cpu=np.array([prefix]), vocab_size=100)
    runner.input_ids = NS(gpu=torch.tensor([7, *drafts] + [0] * 60))
    runner.drafter = NS(proposed_here=lambda r, d: True, tree_for=lambda r, d, shape=None: tree,
                        last_depth=max(parents) + 1)


def _start_worker(glue, config):
    worker = glue.worker.TreeNPUWorker(config, 0, 0, "tcp://127.0.0.1:0")
    worker.init_device()
    return worker


def test_the_worker_starts_the_tree_runner_and_registers_the_backend(glue):
    worker = _start_worker(glue, _config())
    runner = worker.model_runner
    stub = glue.stubs
    assert type(runner).__name__ == "TreeNPUModelRunner"
    assert isinstance(runner, stub.NPUModelRunner)
    assert stub.NPUWorkerModule.NPUModelRunner is stub.NPUModelRunner  # swap undone
    gqa = NS(use_mla=False, use_sparse=False)
    assert stub.NPUPlatform.get_attn_backend_cls(None, gqa) == (
        "vllm_treespec.vllm_glue.ascend.backend.TreeAscendAttentionBackend")
    with pytest.raises(TreeSpecConfigError, match="AscendMLABackend"):
        stub.NPUPlatform.get_attn_backend_cls(None, NS(use_mla=True, use_sparse=False))
    backend = glue.backend.TreeAscendAttentionBackend
    assert backend.get_impl_cls() is glue.backend.TreeAscendAttentionImpl
    assert backend.get_builder_cls() is glue.backend.TreeAscendMetadataBuilder
    assert issubclass(runner._tree_proposer_class(), stub.AscendEagleProposer)


@pytest.mark.parametrize("change, named", [
    ({"block_size": 16}, "'block_size' has invalid value 16"),
    ({"cache_dtype": "int8"}, "'kv_cache_dtype'"),
    ({"quant": NS(enable_c8_quant=True)}, "C8"),
    ({"use_mla": True}, "MLA"),
])
def test_the_worker_refuses_unsupported_setups_at_startup(glue, change, named):
    with pytest.raises(TreeSpecConfigError, match=named):
        glue.worker.TreeNPUWorker(_config(**change), 0, 0, "tcp://127.0.0.1:0")


@pytest.mark.parametrize("change, named", [
    ({"alibi_slopes": [0.5, 0.25]}, "ALiBi"),
    ({"logits_soft_cap": 50.0}, "soft-capping"),
    ({"sliding_window": 128}, "sliding-window"),
    ({"sinks": torch.zeros(4)}, "sinks"),
])
def test_each_layer_refuses_features_the_tree_calls_ignore(glue, change, named):
    _impl(glue)  # the stock arguments pass
    with pytest.raises(TreeSpecConfigError, match=named):
        _impl(glue, **change)


def test_a_c8_quantised_layer_is_refused(glue):
    with pytest.raises(TreeSpecConfigError, match="enable_c8_quant"):
        _impl(glue, config=_config(quant=NS(enable_c8_quant=True)))


def test_the_builder_lifts_the_16_token_limit_in_tree_mode(glue):
    config = _config(num_speculative_tokens=32)
    builder = glue.backend.TreeAscendMetadataBuilder(None, [], config, "cpu")
    assert builder.decode_threshold == 33 == builder.reorder_batch_threshold
    assert config.speculative_config.num_speculative_tokens == 32
    with pytest.raises(AssertionError):  # the stock builder's own limit, kept by the stub
        glue.stubs.AscendAttentionMetadataBuilder(None, [], config, "cpu")


def test_buffers_are_reserved_inside_the_profiling_run(glue):
    config = _config()
    worker = _start_worker(glue, config)
    impl = _impl(glue, config=config)
    config.compilation_config.static_forward_context.update(
        {"model.layers.0.self_attn.attn": NS(impl=impl, attn_backend=object)})
    worker.model_runner.profile_run()
    held = glue.backend.tree_buffers(config, impl.tree_heads, impl.tree_size,
                                     torch.float32, "cpu").reserved_bytes("full_mask")
    # What the stub's profile_run saw allocated when vLLM would measure its peak.
    assert worker.model_runner.seen_at_profiling == held > 0


def test_kv_cache_startup_fails_without_groups_or_with_a_swapped_impl(glue, monkeypatch):
    config = _config()
    worker = _start_worker(glue, config)
    runner = worker.model_runner
    monkeypatch.setattr(runner, "_calibrate_kernels", lambda: None)
    monkeypatch.setattr(runner, "_calibrate_step_cost", lambda: None)
    kv = NS(kv_cache_groups=[object()])
    impl = _impl(glue, config=config)
    layers = config.compilation_config.static_forward_context
    layers["model.layers.0.self_attn.attn"] = NS(impl=impl, attn_backend=object)
    runner.stub_backends = [glue.backend.TreeAscendAttentionBackend]
    runner.initialize_kv_cache(kv)
    runner.stub_backends = []
    with pytest.raises(TreeSpecConfigError, match="no attention groups"):
        runner.initialize_kv_cache(kv)
    runner.stub_backends = [glue.backend.TreeAscendAttentionBackend]
    impl.__class__ = glue.stubs.AscendC8AttentionBackendImpl  # what vllm-ascend's kv_c8 does
    with pytest.raises(TreeSpecConfigError, match="AscendC8AttentionBackendImpl"):
        runner.initialize_kv_cache(kv)


# Where the glue hooks vllm-ascend: (our class, the stub class it overrides, method).
def _hooks(glue):
    b, s = glue.backend, glue.stubs
    runner = glue.runner.tree_npu_runner_class(s.NPUModelRunner)
    return [(b.TreeAscendAttentionImpl, s.AscendAttentionBackendImpl, name)
            for name in ("__init__", "forward", "forward_impl", "update_graph_params")] + [
        (b.TreeAscendMetadataBuilder, s.AscendAttentionMetadataBuilder, "__init__"),
        (b.TreeAscendAttentionBackend, s.AscendAttentionBackend, "get_impl_cls"),
        (b.TreeAscendAttentionBackend, s.AscendAttentionBackend, "get_builder_cls"),
        (glue.worker.TreeNPUWorker, s.NPUWorker, "__init__"),
        (glue.worker.TreeNPUWorker, s.NPUWorker, "init_device"),
        (runner, s.NPUModelRunner, "_prepare_inputs"),
        (runner, s.NPUModelRunner, "profile_run"),
        (runner, s.NPUModelRunner, "initialize_kv_cache"),
        (glue.proposer.tree_ascend_proposer_class(), s.AscendEagleProposer,
         "set_inputs_first_pass"),
    ]


def test_every_hook_the_glue_overrides_exists_in_vllm_ascend_with_a_compatible_call(glue):
    for ours, stock, name in _hooks(glue):
        assert name in stock.__dict__, f"vllm-ascend's {stock.__name__} has no {name}"
        mine = inspect.getattr_static(ours, name)
        assert mine is not stock.__dict__[name], f"{ours.__name__} does not override {name}"
        theirs = inspect.signature(getattr(stock, name))
        fn = getattr(ours, name)
        # vllm-ascend's own call shape (its parameters, positionally) must bind to ours.
        placeholders = [None] * sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                                    and p.default is p.empty
                                    for p in theirs.parameters.values())
        inspect.signature(fn).bind(*placeholders)


def test_a_branching_trees_rows_get_depth_positions_where_vllm_ascend_reads_them(glue):
    """The stub runner's ``_prepare_inputs`` writes linear positions and computes the
    slot mapping from them, as vllm-ascend's does; its forward hands
    ``self.positions`` to ``update_cos_sin`` (the rotary cos/sin gather)."""
    worker = _start_worker(glue, _config())
    runner = worker.model_runner
    # One request: prefix of 5 tokens, root at position 5, drafts a, b (children of
    # the root) and c (child of a): depths 1, 1, 2.
    _seat_request(runner, prefix=5, drafts=[11, 12, 13], parents=[0, 0, 1])
    out = runner._prepare_inputs(runner.scheduler_output, np.array([4]))
    assert len(out) == 3 and out[2] == 4  # NPUModelRunner's three values, restored
    assert runner.slot_positions == [5, 6, 7, 8]  # the slots stay linear
    runner.stub_forward(4)
    assert glue.stubs.state.cos_sin_positions == [[5, 6, 6, 7]]  # root + depth


def test_a_non_uniform_full_graph_capture_says_how_to_fix_it(glue, monkeypatch):
    from vllm.config import CUDAGraphMode

    monkeypatch.setenv("VLLM_TREESPEC_ASCEND_FULL_GRAPH", "1")
    impl = _impl(glue)  # tree size 1 + 3
    monkeypatch.setattr(glue.backend._EXTRA_CTX, "capturing", True)
    monkeypatch.setattr(glue.backend, "get_forward_context",
                        lambda: NS(cudagraph_runtime_mode=CUDAGraphMode.FULL))
    assert impl._captures_tree(NS(actual_seq_lengths_q=[4, 8]))
    with pytest.raises(RuntimeError, match=r"lengths \[3, 4\].*Fix: unset "
                                           r"\$VLLM_TREESPEC_ASCEND_FULL_GRAPH.*multiples of 4"):
        impl._captures_tree(NS(actual_seq_lengths_q=[4, 7]))
