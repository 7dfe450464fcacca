"""What DeepSpeed's pdsh runner hands every node's shell: refuse what that shell would run, warn about secrets.

The runner joins `export NAME=value; ...; cd <launch dir>; python -m deepspeed.launcher.launch ... <script>
<arguments>` into one line that ssh gives each node's shell; it quotes arguments only against spaces and the
directory not at all, so `$(...)`, backticks and `;` in them run there (app/ds/internals/launcher.py reads its
rules).
"""
import os
import re

from app.distributed import dist
from app.ds import internals as ds_internals
from app.errors import UserError
from app.redact import has_password, looks_secret

SAFE = re.compile(r"[\w@%+=:,./-]")  # what a POSIX shell reads as itself outside quotes
FIX = "rename it, or start each node yourself (deepspeed --no_ssh --node_rank K, docs/multinode.md)"


def first_expansion(line: str) -> str:
    """'' when a POSIX shell reads line as plain words, else the first piece it would run or expand."""
    quote, index = "", 0
    while index < len(line):
        char = line[index]
        if quote == "'":
            quote = "" if char == "'" else quote
        elif quote == '"':
            if line.startswith('\\"', index):
                index += 1  # DeepSpeed's own escape of a double quote in an argument
            elif char in "$`\\":  # these expand, or escape and so change the word
                return line[index:index + 2]
            quote = "" if char == '"' else quote
        elif char in "'\"":
            quote = char
        elif not (SAFE.match(char) or char == " "):
            return line[index:index + 2]
        index += 1
    return f"an unclosed {quote}" if quote else ""


def check_arguments(user_args: list, cwd: str):
    """Refuse, in one line, an argument or launch directory that the nodes' shells would run or expand."""
    for arg in user_args:
        piece = first_expansion(" ".join(ds_internals.pdsh_words([arg])))
        if piece:
            raise UserError(f"argument {arg!r} holds {piece!r}, which DeepSpeed's pdsh launcher hands unquoted to "
                            f"every node's shell, where it would run or expand; {FIX}")
    piece = first_expansion(cwd) or ("a space" if re.search(r"\s", cwd) else "")
    if piece:
        raise UserError(f"the launch directory {cwd!r} holds {piece!r}, which DeepSpeed's pdsh launcher hands "
                        f"unquoted to every node's shell (`cd {cwd};`); launch from a folder whose path has none")


def check_hosts(hosts, where: str):
    """Refuse a host name that ssh and pdsh would read as an option (code on this machine)."""
    for host in hosts:
        if str(host).startswith("-"):
            raise UserError(f"{where}: host name {host!r} begins with '-', which ssh reads as an option; "
                            f"fix the hostfile")


def secrets_warning(names) -> str:
    """One line naming the secret-looking variables among those DeepSpeed's pdsh runner puts on its command line
    (names), which every user of the machine can read in the process list; '' when there are none."""
    secret = sorted({name for name in names if looks_secret(name) or has_password(os.environ.get(name, ""))})
    if not secret:
        return ""
    return (f"warning: {', '.join(secret)} travel{'s' if len(secret) == 1 else ''} to the nodes on DeepSpeed's "
            f"pdsh command line, which every user of the machine can read; keep secrets in a file only you can "
            f"read (docs/trust.md)")


def check_launch_hosts():
    """Before the ranks meet, in a rank that DeepSpeed's pdsh runner started: refuse a host that is an ssh option
    (pdsh already ran it; the rank on that host never starts, so the run would wait for it)."""
    if ds_internals.started_by_pdsh():
        check_hosts(ds_internals.launcher_world_info(), "the hostfile")


def check_launch_line(argv: list):
    """Once the ranks have met: rank 0 of a pdsh launch refuses what the nodes' shells ran or expanded (too late for
    them, but the run stops before it writes anything) and warns about secrets on pdsh's command line."""
    problem = ""
    if dist.is_main() and ds_internals.started_by_pdsh():
        try:
            warning = _line_problems(argv)
            if warning:
                print(warning, flush=True)
        except UserError as e:
            problem = str(e)
    problem = dist.broadcast_object(problem)  # rank 0 alone may see the line as it was sent
    if problem:
        raise UserError(problem)  # every rank ends; rank 0 says it


def _line_problems(argv: list) -> str:
    """Refuse what the nodes' shells ran or expanded; the secrets warning, or ''."""
    sent = ds_internals.node_shell_line()  # as pdsh sent it, before a shell expanded it
    if sent is None:  # not to be seen from this node: what the shell expanded is gone, what survived is here
        check_arguments(argv, os.getcwd())
        return secrets_warning(name for name, _ in ds_internals.pdsh_exports(os.environ))
    exported, cwd, tail = sent
    piece = first_expansion(cwd) or first_expansion(tail)
    if piece:
        raise UserError(f"DeepSpeed's pdsh launcher handed every node's shell {piece!r} unquoted (in an argument or "
                        f"the launch directory), which it ran or expanded there; {FIX}")
    return secrets_warning(exported)
