"""The app's own Settings (what DeepSpeed's JSON does not own) and the command line."""
import argparse
from dataclasses import dataclass, fields

from app.distributed import dist
from app.ds.config import DEFAULT_DS_CONFIG, load_ds_config
from app.errors import UserError


@dataclass
class Settings:
    """What the app itself owns; everything about optimisation lives in the DeepSpeed JSON."""
    model: str = "cnn"
    """cnn, mlp, a torchvision classifier (resnet18, ...), a transformers preset, save_pretrained folder or hub name."""
    model_weights: str = ""
    """torchvision classifiers: pretrained weights to start from, torchvision's (DEFAULT, IMAGENET1K_V2, ...: fetched
    once into TORCH_HOME) or a state-dict file; the classifier's head is new, sized to the data's classes."""
    dataset: str = "digits"
    """Images: digits, synthetic, mnist, fashion_mnist, cifar10, imagefolder. Text (transformers models): a
    .txt/.json/.jsonl/.csv/.parquet file or a folder of them, or a hub dataset name; several, comma-separated (a,b),
    train together (--mix_weights)."""
    task: str = "auto"
    """Text: causal_lm, instruction, preference, grpo or sequence_classification; auto takes the model's own (presets:
    gpt2-* and llama-* causal_lm, bert-tiny sequence_classification; folders and hub models: the architecture in
    their config), and a causal LM whose rows hold 'messages', or 'prompt' and 'completion', fine-tunes on
    instructions; one whose rows hold 'chosen' and 'rejected' answers, on preferences (preference)."""
    tokenizer: str = ""
    """Text: '' uses the model folder's tokenizer, else a byte-level one built locally; 'bytes'; 'bpe' (trained on
    the data up to the model's vocabulary); or a tokenizer folder or hub name. Saved in output_dir/tokenizer."""
    block_size: int = 0
    """Text: tokens per language-model block, or the length rows are cut to for classification (0: the model's
    positions, at most 1024)."""
    text_column: str = ""
    """Text: the column holding the text (default: 'text', or the only string column)."""
    train_on_prompt: bool = False
    """Instruction data: train on the whole rendered text, not only on the assistant's answers."""
    packing: str = "auto"
    """Instruction data: pack rows into blocks of --block_size tokens, position ids restarting at each row and
    attention kept within it (checked at start); on, off, or auto (on for instruction data)."""
    attention: str = ""
    """Transformers models: the attention (eager, sdpa, flex_attention, flash_attention_2, ...); '' their default."""
    tiled: str = "auto"
    """Transformers models: each block's MLP, and the output layer with the loss, by tiles; auto: under SP."""
    eval_answers: int = 3
    """Instruction data: held-out prompts the model answers (greedy) at each evaluation, shown and written to
    output_dir/answers/step<N>.jsonl (0: none)."""
    answer_tokens: int = 64
    """Instruction data: the most tokens of each of those answers."""
    preference_loss: str = "sigmoid"
    """Preference pairs: sigmoid (DPO), ipo, hinge, or simpo (no reference; length-normalised, margin --simpo_gamma)."""
    beta: str = "auto"
    """How far from the reference the loss lets the model go (smaller: further): preference pairs 0.1 (auto; SimPO's
    paper uses 2 to 2.5), grpo the KL term's weight, 0 (auto: no KL term and no reference, as TRL)."""
    simpo_gamma: float = 0.5
    """Preference pairs, --preference_loss simpo: the reward margin the loss asks of the chosen answer."""
    reference: str = "live"
    """Preference pairs: live (under --lora the model with its adapters off, else a frozen copy built as the
    model is, partitioned under ZeRO-3) or precompute (one pass before training, kept beside the tokenized data)."""
    reward: str = ""
    """grpo: the reward functions, FILE.py:NAME[,FILE.py:NAME...], each fn(prompts, completions, completion_ids,
    **columns) -> a float or None per completion, as TRL's GRPOTrainer calls them (docs/rl.md)."""
    reward_weights: str = ""
    """grpo: each reward function's weight in the sum, in order (default: 1 each)."""
    num_generations: int = 8
    """grpo: completions sampled for each prompt, compared within their group (at least 2)."""
    max_completion_length: int = 256
    """grpo: the most tokens of each completion; one cut there has not ended (docs/rl.md)."""
    temperature: float = 1.0
    """grpo: the sampling temperature of the completions (and of the log-probabilities the loss takes)."""
    top_p: float = 1.0
    """grpo: sample from the smallest set of tokens whose probabilities reach top_p (1: all)."""
    top_k: int = 0
    """grpo: sample from the top_k most likely tokens (0: all)."""
    grpo_loss: str = "dapo"
    """grpo: dapo (every completion token of the optimizer step weighs the same), grpo (each completion's token mean,
    then their mean) or dr_grpo (token sums over completions x --max_completion_length)."""
    epsilon: float = 0.2
    """grpo: the clipping of the probability ratio below 1 (and above, unless --epsilon_high)."""
    epsilon_high: float = 0.0
    """grpo: the clipping of the ratio above 1 (0: --epsilon; DAPO uses 0.28)."""
    scale_rewards: str = "group"
    """grpo: advantages are rewards less their group's mean, over the group's std (group), the step's (batch) or 1."""
    log_completions: bool = False
    """grpo: write each step's completions, rewards and advantages to output_dir/completions/step<N>.jsonl."""
    eval_sampling: str = "greedy"
    """grpo: each held-out prompt's completion at an evaluation, greedy or sampled as in training (seeded)."""
    gather_for_generation: str = "auto"
    """grpo, ZeRO-3: gather the whole model once to sample (on) or per layer per token (off); auto: where it fits."""
    mask_truncated_completions: bool = False
    """grpo: leave completions cut at --max_completion_length out of the loss (they count in the metrics)."""
    num_iterations: int = 1
    """grpo: optimizer steps on each batch of completions (TRL's mu), clipped against the policy that sampled it."""
    lora: bool = False
    """Transformers models: train low-rank adapters (LoRA, through HF peft) and freeze the base model; checkpoints
    hold the adapters, and app.tools.export writes the adapter folder or the merged model."""
    lora_rank: int = 8
    """LoRA: the adapters' inner size r."""
    lora_alpha: float = 16.0
    """LoRA: the adapters' scale is alpha / rank."""
    lora_dropout: float = 0.0
    """LoRA: dropout on the adapters' input."""
    lora_targets: str = "all-linear"
    """LoRA: the modules that get adapters: all-linear (every linear layer but the output layer), or q_proj,v_proj..."""
    label_column: str = ""
    """Text classification: the column holding the label (default: 'label' or 'labels')."""
    dataset_config: str = ""
    """Text: the configuration name of a hub dataset (e.g. wikitext-2-raw-v1)."""
    dataset_train_split: str = "train"
    """Text: the split to train on, of a hub dataset or a folder that names its splits (e.g. train_prefs)."""
    dataset_test_split: str = ""
    """Text: the split of held-out rows (default: validation, else test, else --eval_fraction of the training rows)."""
    eval_file: str = ""
    """Text: a file of held-out rows (with several --dataset sources, one per source: a,b); otherwise the dataset's
    validation/test split, else --eval_fraction."""
    mix_weights: str = ""
    """Text, several --dataset sources: each one's weight in the mix, in order (e.g. 2,1); each epoch draws its rows
    from them by these shares. Default: the sources concatenated, each row once an epoch."""
    streaming: str = "off"
    """Text: on streams the training rows, tokenized as read (needs --max_steps, and --eval_file or hub validation)."""
    shuffle_buffer: int = 10000
    """Text, --streaming on: rows shuffled in a buffer of this many (0: in file order)."""
    mix_by: str = "rows"
    """Text, --mix_weights: the weights are shares of the rows drawn (rows) or of their tokens (tokens)."""
    eval_fraction: float = 0.1
    """Text: share of the training rows held out when there is no --eval_file or validation split."""
    peak_flops: float = 0.0
    """FLOP/s one rank can reach, for model FLOP utilisation; 0 measures a matmul at start-up."""
    data_dir: str = "data"
    """Where torchvision datasets live (downloaded there when online) and ImageFolder reads."""
    image_size: int = 224
    """Side in pixels that ImageFolder images are resized and cropped to."""
    epochs: int = 10
    """Passes over the training set (ignored when max_steps is set)."""
    max_steps: int = 0
    """Optimizer steps to run, across epochs; 0 means train for --epochs."""
    eval_interval: int = 0
    """Evaluate every N optimizer steps; 0 means at the end of each epoch. Always at the end."""
    log_interval: int = 10
    """Write a metrics row (and a log line) every N optimizer steps."""
    output_dir: str = ""
    """Directory for metrics, plots and TensorBoard files; default runs/<dataset>-<model>-<time>."""
    overwrite: bool = False
    """Allow writing into an output_dir that already holds a run."""
    save_interval: int = 0
    """Save a checkpoint every N optimizer steps (0: only at the end, which always saves)."""
    keep_last: int = 3
    """Keep the newest K complete checkpoints (0 keeps all)."""
    max_nonfinite_steps: int = 10
    """Optimizer steps in a row whose loss or gradient norm is not finite that end the run in one line (0: never);
    no checkpoint is ever written from weights that are not finite."""
    resume: str = ""
    """'auto': continue from the newest complete checkpoint in output_dir (fresh if none); or a checkpoint path."""
    seed: int = 42
    """Seed for model initialisation and data order (identical on every rank)."""
    num_workers: int = -1
    """DataLoader worker processes per rank; -1 (auto): on a GPU up to 4 (a core left for training) for data
    read or decoded per sample, 0 for data already in memory and on a CPU, whose cores train."""
    pin_memory: str = "auto"
    """Pinned host memory for batches, so copies to the GPU overlap compute: on, off, or auto (on with CUDA)."""
    single_process: bool = False
    """Without a launcher, stay in one process even when several GPUs are present."""
    grace_period: int = 60
    """Seconds a SIGTERM/SIGINT'd run may take to finish its step and save before it is ended."""
    dist_timeout: int = 600
    """Seconds a collective may wait before the run fails instead of hanging."""
    profile: str = ""
    """FIRST:LAST records a torch.profiler trace of those optimizer steps (e.g. 5:8) into output_dir/profile, for
    Perfetto or TensorBoard (docs/watching.md)."""
    profile_ranks: str = "main"
    """--profile on the main rank alone (main) or on every rank, one file each (all)."""
    memory_snapshot: str = "on"
    """CUDA: an out-of-memory writes who held the memory to output_dir/memory/ (docs/watching.md); on or off."""
    report_to: str = ""
    """Trackers besides TensorBoard, comma-separated: wandb, comet, mlflow (docs/watching.md); a ds_config's own
    wandb, comet and csv_monitor sections report too."""
    early_stopping_patience: int = 0
    """Stop the run, saved and exit 0, after N evaluations in a row without improvement (0: never)."""
    early_stopping_metric: str = ""
    """The evaluation that early stopping and --keep_best watch, NAME or NAME:min / NAME:max (default: min for a
    loss or perplexity, max for anything else, e.g. eval_reward_accuracy); '': the task's own (eval_loss; GRPO's
    eval_reward)."""
    keep_best: bool = False
    """Keep the checkpoint of the best evaluation (--early_stopping_metric) besides the newest --keep_last."""
    compile: str = "auto"
    """torch.compile the model and its loss through engine.compile: on, off, or auto (on with a CUDA device,
    off on CPU, where the compile time is not won back; docs/gpu.md, "Compile")."""
    tf32: str = "on"
    """fp32 runs on CUDA: 'on' lets matmuls and convolutions use TF32 tensor cores, 'off' keeps full fp32."""
    deepspeed_config: str = str(DEFAULT_DS_CONFIG)
    """Path of the DeepSpeed JSON file."""

    def beta_or(self, default: float) -> float:
        """--beta as a number: the task's default where it is auto."""
        if self.beta == "auto":
            return default
        try:
            return float(self.beta)
        except (TypeError, ValueError):
            raise UserError(f"--beta must be a number or auto, got {self.beta!r}") from None

    def __post_init__(self):
        for name in ("epochs", "log_interval", "dist_timeout", "image_size", "grace_period"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_steps", "eval_interval", "save_interval", "keep_last", "block_size", "peak_flops",
                     "eval_answers", "answer_tokens", "max_nonfinite_steps", "shuffle_buffer",
                     "early_stopping_patience"):
            if getattr(self, name) < 0:
                raise UserError(f"--{name} must be 0 or more, got {getattr(self, name)}")
        if self.num_workers < -1:
            raise UserError(f"--num_workers must be -1 (auto) or more, got {self.num_workers}")
        for name, allowed in (("compile", ("auto", "on", "off")), ("tf32", ("on", "off")),
                              ("packing", ("auto", "on", "off")), ("mix_by", ("rows", "tokens")),
                              ("streaming", ("off", "on")), ("tiled", ("auto", "on", "off")),
                              ("pin_memory", ("auto", "on", "off")), ("reference", ("live", "precompute")),
                              ("preference_loss", ("sigmoid", "ipo", "hinge", "simpo")),
                              ("grpo_loss", ("dapo", "grpo", "dr_grpo")),
                              ("scale_rewards", ("group", "batch", "none")), ("profile_ranks", ("main", "all")),
                              ("memory_snapshot", ("on", "off")), ("gather_for_generation", ("auto", "on", "off")),
                              ("eval_sampling", ("greedy", "sampled"))):
            if getattr(self, name) not in allowed:
                raise UserError(f"--{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.streaming == "on" and not self.max_steps:
            raise UserError("--streaming on reads the data pass after pass, with no end an epoch could count: set "
                            "--max_steps")
        if self.lora_rank < 1:
            raise UserError(f"--lora_rank must be at least 1 (the adapters' inner size; 8 to 64 is usual), got "
                            f"{self.lora_rank}")
        if self.lora_alpha <= 0 or not 0 <= self.lora_dropout < 1:
            raise UserError(f"--lora_alpha must be above 0 and --lora_dropout at least 0 and below 1, got "
                            f"{self.lora_alpha} and {self.lora_dropout}")
        self.beta_or(0.0)  # a number or "auto"; each task checks its own range
        steps_of(self.profile)
        if self.num_generations < 2 or self.max_completion_length < 1:
            raise UserError(f"--num_generations must be at least 2 (a group's rewards are compared with each other) "
                            f"and --max_completion_length at least 1, got {self.num_generations} and "
                            f"{self.max_completion_length}")
        if not 0 < self.eval_fraction < 1:
            raise UserError(f"--eval_fraction must be between 0 and 1, got {self.eval_fraction}")


def steps_of(text: str) -> tuple:
    """(first, last) of --profile's FIRST:LAST, or () for ''; a mistake is one line."""
    if not text:
        return ()
    first, _, last = text.partition(":")
    try:
        found = int(first), int(last or first)
    except ValueError:
        found = (0, 0)
    if not 1 <= found[0] <= found[1]:
        raise UserError(f"--profile {text!r}: give the optimizer steps to record as FIRST:LAST, 1 <= FIRST <= LAST "
                        f"(for example 5:8)")
    return found


def _field_help():
    """One help line per Settings field, taken from the docstring under it."""
    import ast
    import inspect
    tree = ast.parse(inspect.getsource(Settings))
    body = tree.body[0].body
    helps = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            helps[node.target.id] = nxt.value.value
    return helps


def build_parser() -> argparse.ArgumentParser:
    """The command line: one flag per Settings field plus DeepSpeed's own arguments."""
    import deepspeed
    parser = argparse.ArgumentParser(
        prog="train.py",
        description="Train a PyTorch model through DeepSpeed. The JSON given by --deepspeed_config "
                    "owns optimizer, scheduler, precision, ZeRO and batch sizes; these flags own the rest.")
    helps = _field_help()
    for f in fields(Settings):
        if f.name == "deepspeed_config":
            continue
        flag = f"--{f.name}"
        if f.type is bool or isinstance(f.default, bool):
            parser.add_argument(flag, action="store_true", help=helps[f.name])
        else:
            kind = type(f.default)
            parser.add_argument(flag, type=kind, default=f.default, help=f"{helps[f.name]} (default: {f.default!r})")
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="Set by the deepspeed launcher; the app reads LOCAL_RANK itself.")
    deepspeed.add_config_arguments(parser)
    return parser


def parse(argv=None):
    """Parse argv into Settings and a checked DeepSpeed dict (world size not applied yet)."""
    args = build_parser().parse_args(argv)
    values = {f.name: getattr(args, f.name) for f in fields(Settings) if f.name != "deepspeed_config"}
    values["deepspeed_config"] = args.deepspeed_config or str(DEFAULT_DS_CONFIG)
    settings = Settings(**values)
    return settings, load_ds_config(settings.deepspeed_config, resolve=False, say=dist.print0)  # precision: once the device is set
