"""Inductor's C++ compiler on the CPU: found the way inductor finds it, and the fix named where there is none.

On the CPU, torch.compile's default backend (Inductor) writes C++ and builds it with the system's compiler. Inductor
looks for it in ``torch/_inductor/cpp_builder.py`` (``cpp_compiler_search`` over ``config.cpp.cxx``): the command in
$CXX, else ``g++`` (``clang++`` on macOS), kept if ``<command> --version`` runs. Without one, the first compiled call
fails deep in a rank with ``InvalidCxxCompiler``; ``_find_cxx`` asks the same question first, so a notebook can say
what to install and fall back to a backend that builds nothing (``aot_eager``). Inductor's opt-in download of gcc
through conda (``TORCH_INDUCTOR_INSTALL_GXX``) is not tried here. On GPUs Inductor writes Triton, not C++: the check
is the CPU's.

Introduced in notebooks/19-torch-compile.ipynb.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

NO_CXX_FIX = (
    "Inductor needs a C++ compiler on the CPU and found none (it tries $CXX, then {default}). Fix: Debian/Ubuntu "
    "`sudo apt install g++`; Fedora `sudo dnf install gcc-c++`; macOS `xcode-select --install`; conda "
    "`conda install -c conda-forge cxx-compiler`; or point CXX at a compiler you have. Until then this notebook "
    "compiles with backend=\"aot_eager\": the same graphs, run by eager kernels, no code generated."
)


def _default_cxx() -> str:
    """The command inductor tries when $CXX is unset: clang++ on macOS, g++ elsewhere (cl on Windows).

    Introduced in notebooks/19-torch-compile.ipynb.
    """
    if sys.platform == "win32":
        return "cl"
    return "clang++" if sys.platform == "darwin" else "g++"


def _find_cxx() -> tuple[str, str] | None:
    """(command, first line of its ``--version``) of the compiler inductor would use, or None where it has none.

    Introduced in notebooks/19-torch-compile.ipynb.
    """
    command = os.environ.get("CXX", _default_cxx())  # as inductor's config reads it: an empty CXX finds nothing
    argv = [command] if sys.platform == "win32" else shlex.split(command)  # "ccache g++" is two words
    if not argv:
        return None
    try:
        out = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):  # not found, not executable, failed or hung
        return None
    lines = (out.stdout or out.stderr).strip().splitlines()
    return command, lines[0] if lines else ""


def pick_backend() -> tuple[str, str]:
    """("inductor", the compiler found) where a C++ compiler runs, else ("aot_eager", the fix in words).

    Introduced in notebooks/19-torch-compile.ipynb.
    """
    found = _find_cxx()
    if found is None:
        return "aot_eager", NO_CXX_FIX.format(default=_default_cxx())
    command, version = found
    return "inductor", f"Inductor will build its C++ with {command} ({version})"
