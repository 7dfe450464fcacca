"""The fp32 values an optimizer keeps per trained parameter, as DeepSpeed builds it from the config's optimizer
section (runtime/engine.py: its own names in any case, else torch.optim's class of that name): what the memory plan
counts beside the masters. A config without one gets the app's AdamW."""

# DeepSpeed's optimizers (lower case) and torch.optim's: the per-parameter states each keeps, as a parameter's count
KEPT = {"adam": 2, "adamw": 2, "lamb": 2, "muadam": 2, "muadamw": 2, "adagrad": 1, "lion": 1,
        "muon": 2,  # momentum for its matrices, AdamW's two moments for the rest: counted as the rest, at most
        "Adadelta": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "SparseAdam": 2, "Rprop": 2, "ASGD": 1,
        "Adafactor": 1}  # torch's Adafactor: a matrix's row and column sums, a vector's whole: at most one


def state_words(ds: dict) -> int:
    """fp32 values the config's optimizer keeps per trained parameter (an optimizer not known here: Adam's two)."""
    section = ds.get("optimizer") or {}
    name, params = str(section.get("type") or "adamw"), section.get("params") or {}
    if name.lower() in ("sgd", "musgd"):
        return 1 if _positive(params.get("momentum", 0)) else 0  # the momentum buffer, made at the first step
    if name == "RMSprop":  # square_avg, and the momentum buffer and centered's grad_avg where asked
        return 1 + _positive(params.get("momentum", 0)) + bool(params.get("centered", False))
    amsgrad = name.lower() in ("adam", "adamw") and params.get("amsgrad") is True  # torch's: the largest second moment
    return KEPT.get(name.lower(), KEPT.get(name, 2)) + amsgrad


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and value > 0
