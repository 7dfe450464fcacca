"""Damaged files the app reads end the run in one line naming the file, before anything is written: each kind of
damage (cut short, not text, of another kind, a folder where a file belongs) on each kind of file (the DeepSpeed
JSON, a model folder's config, weights and tokenizer, data files and images, a checkpoint's own JSON)."""
import json
import shutil

import pytest

from app.checkpoint import outdir
from conftest import REPO, assert_one_error_line, faulty_command, main_each, run, write_text_rows


def cut_short(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2 + 3])  # mid-record: a cut on a line boundary leaves a shorter file


def not_text(path):
    path.write_bytes(bytes(range(256)) * 8)


def a_folder(path):
    path.unlink()
    path.mkdir()


DAMAGE = {"cut short": cut_short, "not text": not_text, "a folder": a_folder}


def _gpt2_folder(folder):
    """A save_pretrained GPT-2 folder (weights, config, tokenizer), built locally."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from app.data.tokenizers import byte_tokenizer
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=64, vocab_size=300)).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def _images(folder, count=4, suffix="png", side=16):
    from PIL import Image
    for name in ("a", "b"):
        (folder / "train" / name).mkdir(parents=True)
        for i in range(count):
            noise = Image.effect_noise((side, side), 60).convert("RGB")  # noise: a body that does not compress away
            noise.save(folder / "train" / name / f"{i}.{suffix}")
    return folder


def _mnist(folder, count=20):
    """data_dir/MNIST/raw as torchvision reads it: the four idx files, small."""
    import struct
    raw = folder / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for split in ("train", "t10k"):
        (raw / f"{split}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, count, 28, 28) +
                                                         bytes(i % 256 for i in range(count * 784)))
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, count) +
                                                         bytes(i % 10 for i in range(count)))
    return raw


def _checkpoint_run(folder):
    """A run folder with one complete checkpoint, as far as resume reads it before building anything."""
    from unit.test_resume import _state, _write_checkpoint
    _write_checkpoint(folder / "checkpoints" / "step00000004", _state())
    return folder


# Which damage each kind of file gets: a folder where an image belongs is just a folder to ImageFolder, and
# one where a torchvision file belongs is a file not there (said so: MNIST is not in <folder>).
KINDS = {"ds_config": DAMAGE, "model config.json": DAMAGE, "model model.safetensors": DAMAGE,
         "model tokenizer.json": DAMAGE, "data file": DAMAGE, "image": ("cut short", "not text"),
         "torchvision file": ("cut short", "not text"), "checkpoint manifest": DAMAGE}


def _cases(tmp):
    """name -> (train.py argv, the damaged file, the damage)."""
    corpus = write_text_rows(tmp / "corpus.txt", 120)
    gpt2, cases = _gpt2_folder(tmp / "gpt2"), {}
    for index, (kind, damage) in enumerate((k, d) for k, damages in KINDS.items() for d in damages):
        case = tmp / f"case{index}"
        if kind == "ds_config":
            path = shutil.copy(REPO / "ds_configs" / "dp.json", tmp / f"case{index}.json")
            argv = ["--deepspeed_config", path, "--max_steps", 2]
        elif kind.startswith("model"):
            folder = shutil.copytree(gpt2, case)
            path, argv = folder / kind.split()[1], ["--model", folder, "--dataset", corpus, "--block_size", 32]
        elif kind == "data file":
            path = write_text_rows(tmp / f"case{index}.jsonl", 80)
            argv = ["--model", "gpt2-tiny", "--dataset", path, "--block_size", 32]
        elif kind == "image":
            path = _images(case) / "train" / "a" / "1.png"
            argv = ["--model", "mlp", "--dataset", "imagefolder", "--data_dir", case, "--image_size", 16]
        elif kind == "torchvision file":
            path = _mnist(case) / "train-images-idx3-ubyte"
            argv = ["--dataset", "mnist", "--data_dir", case]
        else:
            path = _checkpoint_run(case) / "checkpoints" / "step00000004" / "manifest.json"
            argv = ["--resume", "auto", "--output_dir", case]
        output = [] if "--output_dir" in argv else ["--output_dir", tmp / f"out{index}"]
        cases[f"{kind} {damage}"] = ([*argv, "--max_steps", 2, *output], path, damage)
    return cases


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """name -> (exit code, stderr, output folder, damaged file) of every case, run one after another in one process."""
    tmp = tmp_path_factory.mktemp("damaged")
    cases = _cases(tmp)
    for argv, path, damage in cases.values():
        DAMAGE[damage](path)
    results = main_each([argv for argv, _, _ in cases.values()])
    return {name: (*result, argv[argv.index("--output_dir") + 1], path)
            for (name, (argv, path, _)), result in zip(cases.items(), results)}


@pytest.mark.parametrize("case", [f"{kind} {damage}" for kind, damages in KINDS.items() for damage in damages])
def test_a_damaged_file_is_one_line_naming_it(case, outcomes):
    code, stderr, output_dir, path = outcomes[case]
    assert code == 2, stderr[-2000:]
    line = assert_one_error_line(stderr, path.name)
    assert str(path) in line or str(path.parent) in line, line
    resumed = case.startswith("checkpoint manifest")  # that command resumes the run its folder holds
    assert outdir.check(output_dir, overwrite=False, resume=resumed) == "", "the same command can run again"


def test_a_config_value_of_the_wrong_type_names_its_key(tmp_path):
    """DeepSpeed compares them late and names nothing ("'>' not supported between 'str' and 'float'")."""
    argvs = []
    for key, value in (("gradient_clipping", "1.0"), ("optimizer", {"type": "AdamW", "params": {"lr": "2e-3"}}),
                       ("steps_per_print", "often"), ("wall_clock_breakdown", "false")):
        ds = {**json.loads((REPO / "ds_configs" / "dp.json").read_text()), key: value}
        (tmp_path / f"{key}.json").write_text(json.dumps(ds))
        argvs.append(["--deepspeed_config", tmp_path / f"{key}.json", "--output_dir", tmp_path / key])
    lines = [assert_one_error_line(err) for code, err in main_each(argvs)]
    assert "gradient_clipping must be a number, got '1.0' (a string: drop the quotes)" in lines[0]
    assert "optimizer.params.lr must be a number, got '2e-3'" in lines[1]
    assert "steps_per_print must be a whole number, got 'often'" in lines[2]
    assert "wall_clock_breakdown must be true or false, got 'false'" in lines[3]


def test_an_image_cut_short_found_in_training_leaves_the_folder_reusable(tmp_path):
    """A picture whose header reads but whose pixels are cut short is found only when the loader decodes it, by
    the one rank whose shard holds it, while the other goes on into the step's all-reduce: one line naming it
    (not a hang, not the other rank's traceback), and no run files left, so the same command runs once it is
    replaced."""
    images = _images(tmp_path / "images", count=8, suffix="jpg", side=64)
    victim = images / "train" / "b" / "7.jpg"
    victim.write_bytes(victim.read_bytes()[:1500])  # the header whole, the pixels cut short: PIL's verify passes
    args = ["--model", "mlp", "--dataset", "imagefolder", "--data_dir", images, "--image_size", 16, "--max_steps", 20,
            "--output_dir", tmp_path / "run"]
    result = run(faulty_command("deepspeed", 2, *args), timeout=300, APP_PATIENCE_S="1")  # the other rank is blocked
    assert result.returncode == 2 and "mode: " in result.stdout, "found in training, not before"
    assert_one_error_line(result.stdout + result.stderr, str(victim), "is not a readable image",
                          "replace or remove it", anywhere=True)
    assert outdir.check(tmp_path / "run", overwrite=False) == ""
