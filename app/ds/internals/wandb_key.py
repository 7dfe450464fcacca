"""W&B's own search for a login key (its private _login), asked quietly: the public wandb.login prints who is
logged in, which starts W&B's service to ask its server, and a process that cannot reach the server then waits for
that service at exit; it also rewrites the user's W&B settings file."""


def wandb_key_found(wandb) -> bool:
    """Whether W&B finds a key of its own here (WANDB_API_KEY, the .netrc `wandb login` writes, its settings), as
    wandb.init would, without asking, calling out or writing; W&B's own refusal of the key it found raises."""
    from wandb.sdk import wandb_login
    found, _ = wandb_login._login(verify=False, prompt=False, update_api_key=False, _silent=True)
    return bool(found)
