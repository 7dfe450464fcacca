"""Names that look like secrets (an api key, a token, a password), and copies of a dict with their values hidden."""
import re

REDACTED = "<redacted>"
# Whole words of a name, so that TOKENIZERS_PARALLELISM, NCCL_IB_PKEY (a partition key) and
# PYTHON_KEYRING_BACKEND, none a secret, are not taken for one; APITOKEN or ACCESSTOKEN are.
_ENDINGS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "APIKEY")


def looks_secret(name: str) -> bool:
    """True when a variable's or a key's name says its value is a secret: HF_TOKEN, WANDB_API_KEY, api_key."""
    words = [word for word in re.split(r"[^A-Z0-9]+", name.upper()) if word]
    return any(word in ("KEY", "KEYS") or word.endswith(_ENDINGS) for word in words)


# a URL's password: scheme://user:password@host (MLflow's postgresql://..., a dataset's https://user:token@...)
_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*):([^/\s@]+)@")


def has_password(text: str) -> bool:
    """True when text holds a URL with a password in it."""
    return bool(_PASSWORD.search(text))


def without_password(text: str) -> str:
    """text with the password of each URL in it replaced by REDACTED (the user's name stays)."""
    return _PASSWORD.sub(rf"\1:{REDACTED}@", text)


def redacted(value):
    """value with every non-empty string, list or dict under a secret-looking key replaced by REDACTED, and each
    URL's password in a string, at any depth (numbers stay: pad_token_id is no secret)."""
    if isinstance(value, dict):
        return {key: REDACTED if looks_secret(str(key)) and isinstance(item, (str, list, dict)) and item
                else redacted(item)
                for key, item in value.items()}
    if isinstance(value, list):
        return [redacted(item) for item in value]
    return without_password(value) if isinstance(value, str) else value
