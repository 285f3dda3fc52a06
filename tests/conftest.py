"""Shared fixtures: the forkserver that multi-process tests fork their ranks from."""

import multiprocessing

# Ranks fork from a server that has torch and the package imported once (fast start, no
# fork of the pytest process's threads).
multiprocessing.set_forkserver_preload(
    [
        "torch",
        "torch.distributed",
        "pipedream2bw.run.runner",
        "dist_helper",
        "matrix",  # tests/test_matrix.py's ranks: the cells, their jobs and the covering-array library
        # model=hf ranks: transformers takes seconds to import; an absent optional extra is skipped
        "transformers.models.llama.modeling_llama",
        "transformers.models.gpt2.modeling_gpt2",
        "safetensors.torch",
    ]
)
