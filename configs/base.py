"""Keys every deployment shares; a deployment file sets only what differs.

User-facing keys (the contract the checks use): checkpoint.path, io.input, io.output,
io.echo_prompt, generation.batch_size, generation.max_new_tokens, sampling.temperature (0 = greedy),
mesh.data, mesh.model, mesh.expert, mesh.sequence.
"""

from ml_collections import ConfigDict

from sharding.rules import DEFAULT_RULES


def base_config() -> ConfigDict:
    c = ConfigDict()
    # A converted podrun checkpoint (python -m runner.tools.convert). `fetch` names an embedded model
    # that is downloaded and converted into `path` when `path` does not exist yet. `model`
    # ("family:preset") names the architecture a deployment is sized for, so its fit can be checked
    # without the checkpoint; at start the checkpoint's own metadata must agree with it.
    # chat_template: a Jinja chat template (a file, local or gs://, or the template's text) that
    # replaces the checkpoint's own, as vLLM's --chat-template: for example one that renders tools
    # (configs/templates/chatml_tools.jinja for SmolLM2). "" = the checkpoint's own.
    c.checkpoint = ConfigDict({"path": "", "fetch": "", "model": "", "chat_template": ""})
    # Mesh axis sizes; -1 fills with the remaining devices. num_cpu_devices > 0 simulates that many
    # devices when running on CPU (ignored on TPU/GPU).
    # device_memory_gib: HBM per chip, for the memory report (0 = unknown); tpu_topology: what
    # python -m runner.tools.compile compiles for (e.g. "v5e:2x4").
    c.mesh = ConfigDict({"data": -1, "model": 1, "expert": 1, "sequence": 1, "num_cpu_devices": 8,
                         "device_memory_gib": 0.0, "tpu_topology": "",
                         # Multislice: how many slices each axis spans (over the data-center
                         # network); the rest of each axis stays inside a slice.
                         "dcn": {"data": 1, "sequence": 1, "expert": 1, "model": 1}})
    # Logical axis -> mesh axes ("" replicates; "data,expert" shards over both).
    c.rules = ConfigDict({name: ",".join(axes) for name, axes in DEFAULT_RULES.items()})
    # Persistent XLA compilation cache ("" disables it).
    c.compilation_cache = ConfigDict({"dir": "~/.cache/podrun/xla"})
    c.precision = ConfigDict({
        "params": "float32",  # what weights are restored as
        "activations": "float32",
        "kv_cache": "float32",
        "matmul": "highest",  # default | high | highest
        # Weight-only quantisation of every projection (models/quant.py): none | int8 (one scale
        # per output channel) | int4 (groups of 32 with a float16 scale and minimum, as GGUF's
        # Q4_1; the embedding, unembedding and GPT-OSS's experts stay int8).
        "quantize": "none",
        # Under int4 on a CPU with AVX-512 BF16: the products round x and the weights to bfloat16
        # and sum in float32, at twice float32's multiply-adds ("float32": exact products; other
        # CPUs always are). Without batch_invariant, only those of 4 rows or more.
        "int4_activations": "bfloat16",
        # A request's logits (so its tokens, greedy or seeded) the same bits whatever requests
        # share its steps and whichever program runs them (docs/batch-invariance.md says where
        # this holds). False: each row count takes its fastest kernel, and a token may change
        # with the rows beside it.
        "batch_invariant": True,
    })
    # Which kernels run, resolved once per mesh by models/backend.py (none of them changes results).
    c.kernels = ConfigDict({
        # podrun's own CPU kernels (models/kernels): the int8 and int4 products, attention (decode
        # steps and prompts) and (on one device) the float32 projections of a decode step of up to
        # 8 rows, built with g++ on first use (without a compiler: a warning, and XLA). False leaves
        # all of it to XLA (same results; slower, much slower for int8 and int4).
        "enabled": True,
        # NVIDIA GPUs: attention over the pages in the Triton kernel (models/kernels/gpu.py), which
        # reads each row's pages only up to its own position, where XLA's reads every row as far
        # as the step's longest (off until a GPU has timed it). The TPU kernels follow
        # kernels.enabled alone.
        "pallas_attention": False,
        # TPU: GPT-OSS's experts, when many tokens are routed (prefill), as ragged groups of a
        # Pallas grouped matmul (JAX's megablox gmm) instead of buckets padded to a capacity.
        "pallas_moe": False,
        # CPU, one device, float32 unembedding: greedy tokens from an int8 copy of it with error
        # bounds, and the few rows those cannot rule out in float32 (models/kernels/cpu.py,
        # greedy_screened): the same tokens, a quarter of the unembedding's bytes per step.
        "greedy_screen": True,
        # CPU, one device, float32: the projections held in column panels of 64 (models/panels.py),
        # which the product kernel reads as one stream a thread, in decode steps and prefills.
        "panel_weights": True,
    })
    # How the device programs are built and hold their memory.
    c.programs = ConfigDict({
        # One loop over the layers (stacked weights and page pools, models/scan.py) instead of
        # unrolling them: compile time stops growing with depth; see the bench for the speed.
        "scan_layers": False,
        # q/k/v as one matrix product and gate/up as another (models/fused.py): the checkpoint's
        # separate weights are fused once after restore. Same results either way; off because it
        # measured slower: XLA:CPU runs separate products side by side on its two cores, and
        # GPT-OSS-20B's decode on v5e accesses more bytes per step fused (AOT cost analysis).
        "fuse_projections": False,
        # The KV cache donated to each device call and updated in place (False: copied per call).
        "donate_cache": True,
        # CPU, Linux: the engine's weights and KV cache moved onto transparent huge pages (2 MiB,
        # madvise MADV_COLLAPSE), fewer TLB misses as a decode step streams them
        # (runner/engine/hugepages.py).
        "huge_pages": True,
    })
    c.generation = ConfigDict({
        "batch_size": 8,
        "max_prompt_len": 512,
        "max_new_tokens": 128,
        "stop": ("",),  # stop strings ("" entries are ignored)
        "stop_token_ids": (-1,),  # extra stop ids besides the tokenizer's end-of-turn ids (-1 ignored)
        "steps_per_dispatch": 8,  # decode steps per device call
        "reasoning_effort": "medium",  # Harmony (GPT-OSS) chats: low | medium | high
        # The KV cache in pages of this many tokens (runner/engine, docs/paged-engine.md): a row
        # holds the pages its tokens fill, prompts sharing full pages share them, prompts are
        # computed in chunks beside the decoding rows, and a job runs a handful of programs.
        "page_size": 16,
        # The page pool's GiB per device (0 = room for batch_size rows at their longest), and the
        # prompt tokens one step takes beside the decoding rows (chunked prefill).
        "kv_cache_gib": 0.0,
        "chunk_tokens": 256,
        # Admit the requests of larger max_tokens first (input order among equals), so the
        # longest answers do not start last and leave the other rows idle at the job's end.
        "longest_first": True,
    })
    # Several hosts: "auto" initialises jax.distributed on TPU VM pods (or wherever a coordinator
    # is given); "off" never does. On CPU, each process simulates mesh.num_cpu_devices devices.
    c.distributed = ConfigDict({"mode": "auto", "coordinator": "", "num_processes": 0,
                                "process_id": -1, "timeout_s": 300, "heartbeat_timeout_s": 100})
    c.sampling = ConfigDict({"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0})
    # overwrite: a finished io.output is regenerated (else the run says it is done and exits 0).
    # parts > 1 splits the input into that many contiguous parts of about equal estimated work;
    # a run answers part `part` (-1: the index a Kubernetes Indexed Job gives, JOB_COMPLETION_INDEX)
    # into a file of its own beside io.output, and the run that finds every part done writes
    # io.output (docs/parts.md).
    c.io = ConfigDict({"input": "", "output": "", "echo_prompt": False, "overwrite": False,
                       "parts": 1, "part": -1})
    return c
