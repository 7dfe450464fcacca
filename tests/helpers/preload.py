"""What the forkserver of helpers/forks.py imports once, before it forks each command: every heavy import of a
short run (torch's compiler stack, which torch.optim's first optimizer imports, and inductor's, which a compiled run
imports; DeepSpeed and the Muon optimizer its ZeRO check imports; transformers and the tiny models' classes;
datasets; matplotlib for loss.png; the app) and what it asks on its way (the CPU, for DeepSpeed's CPU ops; which of
DeepSpeed's ops this machine can build)."""
import gc
import importlib

import matplotlib

matplotlib.use("Agg")  # as app/observe/runlog.py sets it
for name in ("torch", "torch._dynamo", "torch._inductor.compile_fx", "torch._dynamo.repro.after_dynamo", "deepspeed",
             "transformers", "datasets", "matplotlib.pyplot", "app.train", "app.tools.export",
             # what a run imports on its way: DeepSpeed's Muon (its ZeRO optimizer check), the tiny models' classes
             "deepspeed.runtime.zero.muon.muon_optimizer", "transformers.models.gpt2.modeling_gpt2",
             "transformers.models.llama.modeling_llama", "transformers.models.bert.modeling_bert"):
    importlib.import_module(name)
# what DeepSpeed's CPU optimizers ask of the CPU (py-cpuinfo, a Python process per question): asked once, here
importlib.import_module("app.ds.internals").cpu_info_once()
importlib.import_module("cpuinfo").get_cpu_info()
# which of its ops this machine can build, which DeepSpeed probes (running the C compiler) once per process, when a
# process group is made: probed once, here
getattr(importlib.import_module("deepspeed.ops"), "__compatible_ops__")
gc.freeze()  # every fork's collections skip what was imported here, and leave its pages shared
