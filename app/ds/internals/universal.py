"""python -m app.ds.internals.universal <ds_to_universal's arguments>: DeepSpeed's conversion to a universal
checkpoint, every file it reads loaded as data only (app/ds/internals/safe_load.py)."""
import pickle
import runpy
import sys

from app.ds.internals.safe_load import enforce_in_this_process, refusal

if __name__ == "__main__":
    enforce_in_this_process()
    folder = sys.argv[sys.argv.index("--input_folder") + 1] if "--input_folder" in sys.argv else "the checkpoint"
    try:
        runpy.run_module("deepspeed.checkpoint.ds_to_universal", run_name="__main__", alter_sys=True)
    except pickle.UnpicklingError as e:
        print(f"error: {refusal(e, f'a file under {folder}')}", file=sys.stderr, flush=True)
        sys.exit(1)
