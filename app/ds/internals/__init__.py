"""Every place the app touches DeepSpeed's private internals, in this package (torch's: torch_private.py;
transformers': hf_private.py).

Each function here relies on something DeepSpeed does not promise to keep: attribute names of its engine and
optimizers, the shape of its launcher's arguments, file names it picks, the lines it logs. They were written
against WRITTEN_FOR; `version_note()` says in one line what to do when another version is installed.
"""
from app.ds.internals.parser import Recorder, parse_config, scalar_defaults, section_fields
from app.ds.internals.engine import (autocast_of, config_saved_as, count_every_stage_in_grad_norm, count_skipped_steps,
                                     bad_norms, deepcompile_active, drop_other_stages, engine_hooks_eager,
                                     forget_released_params, forget_unfinished_forward,
                                     forget_parallel_groups, forward_within_the_step, gathered_state_dict,
                                     lighten_plain_step, note_clip_norms,
                                     skip_bad_steps_on_device,
                                     step_bf16_weights_on_device, uncompile)
from app.ds.internals.loss_scale import scale_searching
from app.ds.internals.adam_state import replay_cpu_adam_steps, restore_swapped_adam
from app.ds.internals.device_constants import constants_on_device
from app.ds.internals.gather import whole_bytes, whole_weights
from app.ds.internals.hf_private import unpacked_positions
from app.ds.internals.linear import deepspeed_linear, restore_torch_linear
from app.ds.internals.sequence import sequence_groups, whole_sequences
from app.ds.internals.launcher import (cpu_info_once, drop_shm_names, env_file_problem, launcher_world_info,
                                      node_shell_line, op_loads_quiet, pdsh_exports, pdsh_words, pin_device,
                                      quiet_deepspeed, started_by_pdsh)
from app.ds.internals.state import (deepspeed_estimate, held_weights, module_states, state_bytes, storages,
                                    weights_finite, zero_tensors)
from app.ds.internals.wandb_key import wandb_key_found

WRITTEN_FOR = "0.19.8"
__all__ = ["autocast_of", "Recorder", "parse_config", "scalar_defaults", "section_fields", "config_saved_as",
           "count_every_stage_in_grad_norm", "count_skipped_steps", "bad_norms", "drop_other_stages",
           "engine_hooks_eager", "deepcompile_active", "forget_parallel_groups", "forget_released_params",
           "forget_unfinished_forward",
           "forward_within_the_step",
           "gathered_state_dict",
           "lighten_plain_step", "note_clip_norms", "replay_cpu_adam_steps", "restore_swapped_adam",
           "restore_torch_linear", "deepspeed_linear", "scale_searching",
           "sequence_groups", "whole_sequences", "skip_bad_steps_on_device",
           "step_bf16_weights_on_device", "constants_on_device", "uncompile", "cpu_info_once", "drop_shm_names",
           "env_file_problem", "launcher_world_info", "node_shell_line", "pdsh_exports", "pdsh_words",
           "started_by_pdsh", "op_loads_quiet",
           "pin_device", "quiet_deepspeed", "deepspeed_estimate", "held_weights", "module_states", "state_bytes",
           "storages", "unpacked_positions", "weights_finite", "zero_tensors", "version_note", "WRITTEN_FOR",
           "whole_bytes", "whole_weights", "wandb_key_found"]


def version_note() -> str:
    """'' on the DeepSpeed version this package was written for, else one line saying what to do."""
    import deepspeed
    if deepspeed.__version__ == WRITTEN_FOR:
        return ""
    return (f"warning: DeepSpeed {deepspeed.__version__} is installed but app/ds/internals/ was written for "
            f"{WRITTEN_FOR}; install deepspeed=={WRITTEN_FOR} (requirements.txt), or check each function in "
            f"app/ds/internals/ against this version")
