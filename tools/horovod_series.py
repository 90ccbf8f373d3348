"""The Horovod patch series (scripts/setup/horovod/) as a git repository to work on, and back.

    python tools/horovod_series.py unpack DIR   # the 0.28.1 sdist in DIR as a git repository,
                                                # one commit per patch of the series, in order
    (edit: git commit --fixup, git rebase -i, a new commit for a new patch, ...)
    python tools/horovod_series.py export DIR   # each commit of DIR back to its patch file,
                                                # the series file rewritten in commit order
    python tools/horovod_series.py check        # every patch's header has its fields; the
                                                # series names the patch files present

A patch file is its header, then its diff. The header is the commit's message: the first line
"Subject: ...", then one field per line (a field's text may go on over indented lines):
Name (the file's name after its number), What, Why, Default, Upstream, Tests. The sdist comes
from pip's cache or PyPI (`pip download`), or from a wheelhouse: --sdist PATH.
"""
import argparse
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SERIES_DIR = REPO / "scripts" / "setup" / "horovod"
FIELDS = ("Subject", "Name", "What", "Why", "Default", "Upstream", "Tests")
VERSION = "0.28.1"


def series():
    """The patch files in series order (the series file: one name a line, # comments)."""
    names = [line.split("#")[0].strip() for line in (SERIES_DIR / "series").read_text().splitlines()]
    return [SERIES_DIR / name for name in names if name]


def header_and_diff(text):
    """A patch file's text split at its first 'diff --git' line."""
    at = text.find("\ndiff --git ")
    if at < 0:
        raise ValueError("no 'diff --git' line")
    return text[:at + 1], text[at + 1:]


def fields(header):
    """{field: its text} of a header ("Field: text" lines, indented lines going on)."""
    found, last = {}, None
    for line in header.splitlines():
        match = re.match(r"([A-Z][a-z]+): (.*)", line)
        if match:
            last = match.group(1)
            found[last] = match.group(2)
        elif line.startswith("  ") and last:
            found[last] += " " + line.strip()
    return found


def git(repo, *args, **kwargs):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, text=True,
                          capture_output=True, **kwargs).stdout


def sdist(path):
    if path:
        return Path(path)
    folder = Path(tempfile.mkdtemp(prefix="horovod-sdist-"))
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "horovod",
                    f"horovod=={VERSION}", "-d", str(folder)], check=True)
    return folder / f"horovod-{VERSION}.tar.gz"


def unpack(directory, sdist_path):
    directory = Path(directory)
    if directory.exists():
        sys.exit(f"horovod_series: {directory} exists: choose a new directory")
    with tempfile.TemporaryDirectory() as scratch, tarfile.open(sdist(sdist_path)) as archive:
        archive.extractall(scratch, filter="data")
        Path(scratch, f"horovod-{VERSION}").rename(directory)
    git(directory, "init", "-q")
    git(directory, "add", "-A")
    git(directory, "-c", "user.name=sdist", "-c", "user.email=sdist@localhost",
        "commit", "-q", "-m", f"horovod {VERSION} sdist")
    git(directory, "tag", "sdist")
    for patch in series():
        header, diff = header_and_diff(patch.read_text())
        git(directory, "apply", "--index", "-", input=diff)
        git(directory, "-c", "user.name=series", "-c", "user.email=series@localhost",
            "commit", "-q", "-F", "-", input=header)
    print(f"{directory}: {len(series())} commits over the sdist (tag 'sdist'); export it with "
          f"python tools/horovod_series.py export {directory}")


def export(directory):
    directory = Path(directory)
    commits = git(directory, "rev-list", "--reverse", "sdist..HEAD").split()
    names = []
    for number, commit in enumerate(commits, 1):
        header = git(directory, "log", "-1", "--format=%B", commit).strip() + "\n\n"
        name = fields(header).get("Name")
        if not name:
            sys.exit(f"horovod_series: commit {commit[:10]} has no 'Name:' line in its message")
        diff = git(directory, "diff", "--no-color", "--no-ext-diff", f"{commit}^", commit)
        names.append(f"{number:04d}-{name}.patch")
        (SERIES_DIR / names[-1]).write_text(header + diff)
    for old in SERIES_DIR.glob("[0-9][0-9][0-9][0-9]-*.patch"):
        if old.name not in names:
            old.unlink()
    text = (SERIES_DIR / "series").read_text()
    comments = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
    (SERIES_DIR / "series").write_text(comments + "".join(name + "\n" for name in names))
    print(f"{len(names)} patches written to {SERIES_DIR.relative_to(REPO)}")


def check():
    problems = []
    listed = series()
    for patch in listed:
        if not patch.is_file():
            problems.append(f"{patch.name}: listed in the series, no such file")
            continue
        header, _ = header_and_diff(patch.read_text())
        missing = [field for field in FIELDS if field not in fields(header)]
        if missing:
            problems.append(f"{patch.name}: no {', '.join(missing)} in its header")
    for patch in SERIES_DIR.glob("*.patch"):
        if patch not in listed:
            problems.append(f"{patch.name}: not in the series")
    for problem in problems:
        print(problem)
    return 1 if problems else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    unpacking = commands.add_parser("unpack", help="the sdist with the series as git commits, in DIR")
    unpacking.add_argument("directory")
    unpacking.add_argument("--sdist", help=f"horovod-{VERSION}.tar.gz (default: pip download)")
    exporting = commands.add_parser("export", help="DIR's commits back to the series")
    exporting.add_argument("directory")
    commands.add_parser("check", help="headers and series file")
    args = parser.parse_args()
    if args.command == "unpack":
        unpack(args.directory, args.sdist)
    elif args.command == "export":
        export(args.directory)
    else:
        sys.exit(check())


if __name__ == "__main__":
    main()
