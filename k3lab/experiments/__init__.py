"""The course wing: code the notebooks and their tests use, kept out of the core package (the model,
kernels and trainer). It may import the core; no core module imports it (the ``test_layers`` tests).

* ``nb`` — the notebooks' helpers (versions, parameter checks, the headline line, progress, explorers);
* ``course`` — ``python -m k3lab course``: runs the notebooks through papermill and summarises them;
* ``toy`` — the MQAR toy LM of notebook 01 (any mixer of the linear-attention lineage), trained by ``mqar``;
* ``numerics`` — low-precision tile numerics of the KDA chunk form (notebook 03);
* ``moe_simulate`` — balancing without a language model: synthetic scores, simulated ranks (notebook 08);
* ``expert_demos``, ``parallel_demos`` — the spawned gloo workers of notebooks 10 and 11.
"""
