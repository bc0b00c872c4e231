"""Inductor's C++ compiler on the CPU: found the way inductor finds it, and the fix named where there is none.

On the CPU, torch.compile's default backend (Inductor) writes C++ and builds it with the system's compiler. Inductor
looks for it in ``torch/_inductor/cpp_builder.py`` (``cpp_compiler_search`` over ``config.cpp.cxx``): the command in
$CXX, else ``g++`` (``clang++`` on macOS), kept if ``<command> --version`` runs. Without one, the first compiled call
fails deep in a rank with ``InvalidCxxCompiler``; ``_find_cxx`` asks the same question first, so a notebook can say
what to install and fall back to a backend that builds nothing (``aot_eager``). Inductor's opt-in download of gcc
through conda (``TORCH_INDUCTOR_INSTALL_GXX``) is not tried here.

On a GPU Inductor writes Triton kernels instead, and Triton builds a small C launcher for them
(``triton/runtime/build.py``): it needs the ``triton`` package, a C compiler (``_find_compiler("c")``: $CC, else
``gcc``, else ``clang``) and the running Python's ``Python.h`` (``sysconfig``'s include folder, which Debian ships in
``python3-dev``). ``pick_backend("cuda")`` checks those three and names what to install.

Introduced in notebooks/20-torch-compile.ipynb.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

NO_CXX_FIX = (
    "Inductor needs a C++ compiler on the CPU and found none (it tries $CXX, then {default}). Fix: Debian/Ubuntu "
    "`sudo apt install g++`; Fedora `sudo dnf install gcc-c++`; macOS `xcode-select --install`; conda "
    "`conda install -c conda-forge cxx-compiler`; or point CXX at a compiler you have. Until then this notebook "
    "compiles with backend=\"aot_eager\": the same graphs, run by eager kernels, no code generated."
)


def _default_cxx() -> str:
    """The command inductor tries when $CXX is unset: clang++ on macOS, g++ elsewhere (cl on Windows).

    Introduced in notebooks/20-torch-compile.ipynb.
    """
    if sys.platform == "win32":
        return "cl"
    return "clang++" if sys.platform == "darwin" else "g++"


def _find_cxx() -> tuple[str, str] | None:
    """(command, first line of its ``--version``) of the compiler inductor would use, or None where it has none.

    Introduced in notebooks/20-torch-compile.ipynb.
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


UNTIL = " Until then this notebook compiles with backend=\"aot_eager\": the same graphs, run by eager kernels."
NO_TRITON_FIX = ("Inductor writes Triton kernels for a GPU, and the triton package is not installed. Fix: "
                 "`pip install triton` in this environment (torch's Linux CUDA wheels bring it as a dependency: a "
                 "missing one means the install skipped it)." + UNTIL)
NO_CC_FIX = ("Triton builds a C launcher for each GPU kernel and found no C compiler (it tries $CC, then gcc, then "
             "clang). Fix: Debian/Ubuntu `sudo apt install gcc`; Fedora `sudo dnf install gcc`; conda "
             "`conda install -c conda-forge c-compiler`; or point CC at a compiler you have." + UNTIL)
NO_PYTHON_H_FIX = ("Triton's C launcher includes Python.h, and {include} has none. Fix: Debian/Ubuntu `sudo apt "
                   "install python{version}-dev` (`python3-dev` for the system's default Python); Fedora `sudo dnf "
                   "install python3-devel`; a conda or uv Python ships its headers." + UNTIL)


def _find_cc() -> str | None:
    """The C compiler Triton would use (``_find_compiler("c")`` in triton/runtime/build.py): $CC as given, else the
    ``gcc`` on PATH, else ``clang``; None where there is none."""
    if "CC" in os.environ:
        return os.environ["CC"] or None
    return shutil.which("gcc") or shutil.which("clang")


def _python_include() -> Path:
    """The folder Triton passes to the compiler for Python.h: sysconfig's include path, Debian's posix_local scheme
    read as posix_prefix, as triton/runtime/build.py does."""
    scheme = sysconfig.get_default_scheme()
    if scheme == "posix_local":
        scheme = "posix_prefix"
    return Path(sysconfig.get_paths(scheme=scheme)["include"])


def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def pick_backend(device_type: str = "cpu") -> tuple[str, str]:
    """("inductor", what it will build with) where Inductor can build for ``device_type``, else ("aot_eager", the fix).

    On the CPU Inductor needs a C++ compiler; on a GPU ("cuda") Triton, a C compiler and the headers of the
    running Python (Python.h). The fix names the package that is missing.
    Introduced in notebooks/20-torch-compile.ipynb.
    """
    if device_type == "cuda":
        include = _python_include()
        if not _has_triton():
            return "aot_eager", NO_TRITON_FIX
        cc = _find_cc()
        if cc is None:
            return "aot_eager", NO_CC_FIX
        if not (include / "Python.h").is_file():
            return "aot_eager", NO_PYTHON_H_FIX.format(include=include, version=sysconfig.get_python_version())
        return "inductor", f"Inductor will write Triton kernels; Triton builds their launchers with {cc} and {include}"
    if device_type != "cpu":
        raise ValueError(f"no Inductor check for device type {device_type!r}")
    found = _find_cxx()
    if found is None:
        return "aot_eager", NO_CXX_FIX.format(default=_default_cxx())
    command, version = found
    return "inductor", f"Inductor will build its C++ with {command} ({version})"
