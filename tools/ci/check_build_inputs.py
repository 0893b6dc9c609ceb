#!/usr/bin/env python3
"""Fails if a build read a system file that a fresh Debian machine would not have.

The README promises that deploy/install-deps.sh on a fresh bookworm is all the set-up there is.
CI runs on a machine that has more (a system CUDA toolkit under /usr/local, whose headers it
links into /usr/local/include, among them), and a build that reads one of those files passes
CI and fails for every user: cuda_fp16.h found CCCL's <nv/target> that way from 2026-11-29 to
2026-12-03 (docs/results-deploy.md). This check reads what a finished Ninja build used:

  - the files configure read (`ninja -t inputs build.ninja`: CMake's modules and packages),
  - every header of every compiled file (`ninja -t deps`, the compilers' depfiles, nvcc's too),
  - the programs, and the files named as arguments, of the build's commands (compilers,
    protoc and its plugins, libraries linked by path), and the Python modules that a
    `PYTHON -m MODULE` command imports,
  - the assembler, linker and compilers the drivers find on PATH,
  - every `-lNAME` of a link line where the linker would find it (the line's -L folders, then
    the compiler's, then the linker's own),
  - the shared libraries the built programs load as `ldd` resolves them (without LD_* variables,
    which a fresh machine does not set; libraries opened with dlopen are not seen),

and requires each file that is not the source tree's (tracked by git) or the build folder's to
come from what a fresh machine has after install-deps. A file of install-deps' virtualenv (by
real path) must be listed in the RECORD of a pip package that deploy/python-constraints.txt pins
at the installed version (or be one install-deps makes itself: pyvenv.cfg, its CUDA root's
driver stub); installed packages the lock does not pin at their version are listed as a note.
Any other file must belong to
a package the script installs, one those depend on (Depends and Pre-Depends, recursively; not
Recommends, which it does not install), or the base system (Essential or Priority required, and
apt). A link counts as its package's; an unpackaged link counts as the file it leads to only
through /etc/alternatives. A file in no package (anything under /usr/local, a hand-made link) or
in another package fails, with the package named. Exit 0 when clean, 1 with the offending files
listed, 2 when it cannot check.

  tools/ci/check_build_inputs.py BUILD_DIR [--venv DIR] [--packages P,Q,...] [--python-lock F]
  tools/ci/check_build_inputs.py --self-test
"""
import argparse
import csv
import functools
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile


class CannotCheck(Exception):
    """A tool the check needs failed: exit 2, not a finding."""


def run(cmd, **kw):
    """The standard output of `cmd`; CannotCheck when it fails."""
    try:
        return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise CannotCheck("%s: %s" % (" ".join(cmd), getattr(e, "stderr", "") or e)) from e


def aliases(path):
    """The path, and the same file under merged /usr (/lib and /usr/lib are one folder)."""
    out = [path]
    for top in ("/lib/", "/lib64/", "/bin/", "/sbin/"):
        if path.startswith(top):
            out.append("/usr" + path)
        elif path.startswith("/usr" + top):
            out.append(path[len("/usr"):])
    return out


@functools.lru_cache(maxsize=None)  # read once a process (the self-test checks 13 builds)
def dpkg_owners():
    """Path -> the set of installed packages whose file is there, diversions applied (dash's
    /bin/sh is dash's, not bash's; the diverted original is its package's at the new name)."""
    owners = {}
    for lst in glob.glob("/var/lib/dpkg/info/*.list"):
        pkg = os.path.basename(lst)[:-len(".list")].split(":")[0]
        with open(lst, encoding="utf-8", errors="replace") as f:
            for line in f:
                p = line.rstrip("\n")
                if p:
                    owners.setdefault(p, set()).add(pkg)
    try:
        with open("/var/lib/dpkg/diversions", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for i in range(0, len(lines) - 2, 3):  # triples: the path, where it went, by whom
        path, moved_to, by = lines[i:i + 3]
        listed = owners.get(path, set())
        owners[moved_to] = owners.get(moved_to, set()) | (listed - {by})
        owners[path] = {by} if by != ":" else set()  # ":" is a local diversion
    return owners


@functools.lru_cache(maxsize=None)
def installed_packages():
    """Package -> (essential, priority, [dependency alternatives], [provided names]), for every
    package whose files are on disk (installed, or unpacked with triggers pending)."""
    fmt = ("${Package}\t${db:Status-Status}\t${Essential}\t${Priority}\t${Pre-Depends}\t"
           "${Depends}\t${Provides}\n")
    pkgs = {}
    for line in run(["dpkg-query", "-W", "-f=" + fmt]).splitlines():
        name, status, essential, priority, pre, dep, provides = (line.split("\t") + [""] * 7)[:7]
        if status in ("not-installed", "config-files", ""):
            continue
        groups = []
        for field in (pre, dep):
            for clause in field.split(","):
                alts = [re.sub(r"\(.*?\)|\[.*?\]|<.*?>", "", a).strip().split(":")[0]
                        for a in clause.split("|")]
                alts = [a for a in alts if a]
                if alts:
                    groups.append(alts)
        provided = [re.sub(r"\(.*?\)", "", p).strip().split(":")[0] for p in provides.split(",")]
        pkgs[name] = (essential == "yes", priority, groups, [p for p in provided if p])
    return pkgs


def allowed_closure(roots, pkgs):
    """The installed packages a fresh machine has: the roots, the base system, and every
    installed package that satisfies one of their dependencies (any installed alternative, or
    any installed provider of a virtual name)."""
    providers = {}
    for name, (_, _, _, provided) in pkgs.items():
        for p in provided:
            providers.setdefault(p, set()).add(name)
    base = [n for n, (ess, prio, _, _) in pkgs.items() if ess or prio == "required"] + ["apt"]
    todo = [n for n in list(roots) + base if n in pkgs]
    seen = set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for alts in pkgs[n][2]:
            for a in alts:
                for m in ({a} if a in pkgs else set()) | providers.get(a, set()):
                    if m not in seen:
                        todo.append(m)
    return seen


def install_deps_packages(repo):
    """The Debian packages deploy/install-deps.sh installs (its --list-packages)."""
    return run(["bash", os.path.join(repo, "deploy/install-deps.sh"), "--list-packages"]).split()


# Flags whose value is a file the compiler, nvcc or protoc reads.
FILE_FLAGS = ("-include", "-imacros", "-ccbin", "--compiler-bindir", "-isysroot")
FILE_PREFIXES = ("--plugin=", "-Wl,", "--dependency-file=")


def command_files(words):
    """The absolute paths a command reads, from its words: the program, plain arguments, the
    values of FILE_FLAGS and FILE_PREFIXES; not -D values (a macro's text, such as a path the
    program opens later, if ever) nor folders (-I, -L: what is read from them is seen
    elsewhere)."""
    out = []
    take_next = True  # the program itself
    for w in words:
        if take_next:
            out.append(w)
            take_next = False
        elif w in FILE_FLAGS:
            take_next = True
        elif w.startswith(FILE_PREFIXES):
            out += [p for p in re.split(r"[=,:]", w) if p.startswith("/")]
        elif w.startswith("/"):
            out.append(w)
    return [p for p in out if p.startswith("/") and not p.startswith(("/proc/", "/sys/", "/dev/"))]


def python_module_files(python, module, cwd):
    """The files of every module that `python -m module` has loaded once `module` is imported."""
    code = ("import importlib, sys; importlib.import_module(sys.argv[1]); "
            "print('\\n'.join(sorted({getattr(m, '__file__', None) or '' "
            "for m in list(sys.modules.values())})))")
    return [p for p in run([python, "-c", code, module], cwd=cwd).splitlines() if p]


def build_inputs(build):
    """The files the build read: {path: what read it}; and the -l names not found."""
    found = {}

    def add(path, why):
        path = os.path.normpath(path if os.path.isabs(path) else os.path.join(build, path))
        if os.path.isfile(path):
            found.setdefault(path, why)

    with open(os.path.join(build, "build.ninja"), encoding="utf-8", errors="replace") as f:
        configured = re.search(r"^build build\.ninja:", f.read(), re.M)  # CMake's re-run rule
    if configured:
        for p in run(["ninja", "-C", build, "-t", "inputs", "build.ninja"]).splitlines():
            add(p, "read by configure")
    target = None
    for line in run(["ninja", "-C", build, "-t", "deps"]).splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            target = line.split(":")[0]
        else:
            add(line.strip(), "a header of " + str(target))
    cxx = shutil.which("c++") or "c++"
    lib_dirs = [d for line in run([cxx, "-print-search-dirs"]).splitlines()
                if line.startswith("libraries: =")
                for d in line[len("libraries: ="):].split(":")]
    lib_dirs += [d.lstrip("=") for d in re.findall(r'SEARCH_DIR\("([^"]+)"\)',
                                                    run(["ld", "--verbose"]))]
    # The programs the compiler drivers run by name (gcc's as and ld, nvcc's host compiler when
    # no -ccbin names it): the ones on the build's PATH.
    for tool in filter(None, map(shutil.which, ("as", "ld", "gcc", "g++", "cc", "c++"))):
        add(tool, "found on PATH by the compiler drivers")
    missing = set()
    for line in run(["ninja", "-C", build, "-t", "commands"]).splitlines():
        for part in re.split(r"\s(?:&&|\|\||;)\s", line):
            try:
                words = shlex.split(part)
            except ValueError:
                words = part.split()
            while words and (words[0] in ("cd", "env") or "=" in words[0]
                             and not words[0].startswith("/")):
                words = words[2:] if words[0] == "cd" else words[1:]
            if words and words[0].endswith("/cmake") and words[1:3] == ["-E", "env"]:
                add(words[0], "named in a build command")  # the launcher: ccache runs next
                words = words[3:]
                while words and "=" in words[0] and not words[0].startswith("/"):
                    words = words[1:]
            for p in command_files(words):
                add(p, "named in a build command")
            if len(words) > 2 and words[1] == "-m" and os.path.basename(words[0]).startswith(
                    "python"):
                for p in python_module_files(words[0], words[2], build):
                    add(p, "imported by %s -m %s" % (words[0], words[2]))
            here = [os.path.join(build, w[2:]) for w in words if w.startswith("-L")]
            for lib in (w[2:] for w in words if w.startswith("-l") and len(w) > 2):
                names = [lib[1:]] if lib.startswith(":") else ["lib%s.so" % lib, "lib%s.a" % lib]
                hits = [os.path.join(d, n) for d in here + lib_dirs for n in names
                        if os.path.isfile(os.path.join(d, n))]
                if hits:
                    add(hits[0], "found for -l" + lib)
                else:
                    missing.add(lib)
    # Programs and shared libraries built: what they load at run time, as a fresh machine's
    # loader would find it (no LD_LIBRARY_PATH or LD_PRELOAD).
    env = {k: v for k, v in os.environ.items() if not k.startswith("LD_")}
    for root, dirs, files in os.walk(build):
        dirs[:] = [d for d in dirs if d not in ("CMakeFiles", "Testing")]
        for f in files:
            p = os.path.join(root, f)
            if os.path.islink(p) or (not os.access(p, os.X_OK) and ".so" not in f):
                continue
            with open(p, "rb") as fh:
                if fh.read(4) != b"\x7fELF":
                    continue
            r = subprocess.run(["ldd", p], capture_output=True, text=True, env=env)
            for m in re.finditer(r"=>\s+(/\S+)", r.stdout):
                add(m.group(1), "loaded by " + os.path.relpath(p, build))
    return found, missing


def canonical(name):
    """A pip package's name as PEP 503 compares them (Jinja2 = jinja2, typing_extensions =
    typing-extensions)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path):
    """{package: version} from a pip constraints file of NAME==VERSION lines."""
    lock = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line:
                m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^]]*\])?==(\S+)", line)
                if not m:
                    raise CannotCheck("%s: not NAME==VERSION: %r" % (path, line))
                lock[canonical(m.group(1))] = m.group(3)
    return lock


@functools.lru_cache(maxsize=None)
def venv_packages(venv):
    """({real path: (package, version)} for every file a pip RECORD of the virtualenv lists,
    {package: version} installed)."""
    files, installed = {}, {}
    sites = {os.path.realpath(d) for d in glob.glob(os.path.join(venv, "lib*", "python3*",
                                                                  "site-packages"))}
    for site in sorted(sites):
        for info in glob.glob(os.path.join(site, "*.dist-info")):
            name = version = None
            try:
                with open(os.path.join(info, "METADATA"), encoding="utf-8",
                          errors="replace") as f:
                    for line in f:
                        if not line.strip():
                            break
                        key, _, value = line.partition(":")
                        if key == "Name":
                            name = canonical(value.strip())
                        elif key == "Version":
                            version = value.strip()
                with open(os.path.join(info, "RECORD"), encoding="utf-8", newline="") as f:
                    rows = list(csv.reader(f))
            except OSError:
                continue
            if not name or not version:
                continue
            installed[name] = version
            for row in rows:
                if row and row[0]:
                    files[os.path.normpath(os.path.join(site, row[0]))] = (name, version)
    return files, installed


def venv_package_of(real, venv_real, files):
    """(package, version) of a virtualenv file by its real path; ("", "") for a file
    install-deps makes itself; None for a file of no pip package."""
    rel = os.path.relpath(real, venv_real)
    if rel == "pyvenv.cfg" or rel.startswith("cuda/"):  # links in cuda/ are judged where they lead
        return "", ""
    if real in files:
        return files[real]
    # Bytecode Python wrote on import, after pip's RECORD: the package of its source file.
    m = re.fullmatch(r"(.*)/__pycache__/([^/.]+)\.[^/]*\.pyc", real)
    return files.get("%s/%s.py" % m.groups()) if m else None


def tracked_files(repo):
    """The source tree's files as git tracks them (ignored ones, such as a copy of a system
    header under .deps/, are not the tree's), or every file under it without git."""
    try:
        names = run(["git", "-C", repo, "ls-files", "-z"]).split("\0")
    except CannotCheck:
        return None
    return {os.path.normpath(os.path.join(repo, n)) for n in names if n}


def package_of(path, owners):
    """The packages of a file as the build used it: the path's own (a development link such as
    libz.so is zlib1g-dev's, whatever it leads to); for a link of no package, the file it leads
    to only through /etc/alternatives (/usr/bin/c++), never through a hand-made link."""
    who = set().union(*(owners.get(c, set()) for c in aliases(path)))
    hop = path
    for _ in range(40):
        if who or not os.path.islink(hop):
            break
        nxt = os.path.normpath(os.path.join(os.path.dirname(hop), os.readlink(hop)))
        if not (hop.startswith("/etc/alternatives/") or nxt.startswith("/etc/alternatives/")):
            break
        hop = nxt
        who = set().union(*(owners.get(c, set()) for c in aliases(hop)))
    return who


def check(build, repo, venv, roots, lock):
    """(exit status, report lines) for the Ninja build folder `build`; `lock` is
    {package: version} from deploy/python-constraints.txt."""
    pkgs = installed_packages()
    allowed = allowed_closure(roots, pkgs)
    owners = dpkg_owners()
    tracked = tracked_files(repo)
    # Folders whose every file is the project's, by real path.
    own_dirs = [os.path.realpath(build)] + ([] if tracked is not None
                                            else [os.path.realpath(repo)])
    # The virtualenv's files, by real path: a link in it that leads out of it (its python) is
    # judged by where it leads.
    venv_real = os.path.realpath(venv)
    venv_files, venv_installed = venv_packages(venv_real)
    inputs, missing = build_inputs(build)
    bad, used, used_pip, system, from_venv = [], set(), set(), 0, 0
    for path, why in sorted(inputs.items()):
        real = os.path.realpath(path)
        if (tracked is not None and path in tracked) or any(
                real == d or real.startswith(d + "/") for d in own_dirs):
            continue
        if real.startswith(venv_real + "/"):
            from_venv += 1
            owner = venv_package_of(real, venv_real, venv_files)
            if owner is None:
                bad.append("%s (%s): in the virtualenv but in no pip package's RECORD (copied "
                           "there by hand?)" % (path, why))
            elif owner[0] and lock.get(owner[0]) != owner[1]:
                bad.append("%s (%s): from pip package %s %s, which deploy/python-constraints.txt "
                           "%s" % (path, why, owner[0], owner[1],
                                   "pins at " + lock[owner[0]] if owner[0] in lock
                                   else "does not name"))
            elif owner[0]:
                used_pip.add(owner[0])
            continue
        system += 1
        who = package_of(path, owners)
        if not who:
            bad.append("%s (%s): in no Debian package%s"
                       % (path, why, "" if real == path else ", a link to " + real))
        elif not who & allowed:
            bad.append("%s (%s): from %s, which install-deps does not install"
                       % (path, why, ", ".join(sorted(who))))
        else:
            used |= who & allowed
    notes = ["check_build_inputs: not found where the linker looks, so not checked: -l"
             + ", -l".join(sorted(missing))] if missing else []
    # What else the virtualenv holds that a fresh machine's would not (the tests' Python modules
    # come from it): a note, since the build did not read it.
    drift = sorted("%s %s (lock: %s)" % (n, v, lock.get(n, "none"))
                   for n, v in venv_installed.items()
                   if lock.get(n) != v and n not in ("pip", "setuptools", "wheel"))
    if drift:
        notes.append("check_build_inputs: note: the virtualenv has pip packages that "
                     "deploy/python-constraints.txt does not pin at their version: "
                     + ", ".join(drift))
    if bad:
        more = ["  ... and %d more" % (len(bad) - 40)] if len(bad) > 40 else []
        return 1, ["check_build_inputs: %d of the files this build read would be missing or "
                   "different on a fresh Debian machine after deploy/install-deps.sh:" % len(bad)
                   ] + ["  " + b for b in bad[:40]] + more + notes
    return 0, ["check_build_inputs: %d files read, %d of them system files, each from one of the "
               "%d Debian packages install-deps gives a fresh machine (%d of those packages "
               "used), and %d from %d pip packages at deploy/python-constraints.txt's versions"
               % (len(inputs), system, len(allowed), len(used), from_venv, len(used_pip))
               ] + notes


def self_test():
    """The check on a two-file Ninja project (a header included, a library linked), each case
    with the verdict it must give: a header from the tree passes; a header, a library or a
    virtualenv's link from elsewhere, a hand-made link to a package's file, and a package's
    header and library that the given packages do not cover fail, naming the file (and the
    package); the same package named passes, and so does a -D macro naming a file of no package
    and a run under an LD_LIBRARY_PATH; a virtualenv header passes only when its pip package is
    at the lock's version. 0 when every case gives its verdict."""
    zlib = run(["dpkg-query", "-S", "/usr/include/zlib.h"]).split(":")[0]
    failures = 0
    with tempfile.TemporaryDirectory() as t:
        src, outside, venv = (os.path.join(t, d) for d in ("src", "outside", "venv"))
        for d in (src, outside, venv):
            os.makedirs(d)
        for folder, name in ((src, "inside"), (outside, "outside")):
            with open(os.path.join(folder, name + ".h"), "w") as f:
                f.write("static int %s(void) { return 0; }\n" % name)
        os.symlink(os.path.join(outside, "outside.h"), os.path.join(venv, "venv.h"))
        # A virtualenv with one pip package, pkg_a 1.0 (its header in its RECORD), and a header
        # that no package lists.
        site = os.path.join(venv, "lib", "python3.11", "site-packages")
        os.makedirs(os.path.join(site, "pkg_a"))
        os.makedirs(os.path.join(site, "pkg_a-1.0.dist-info"))
        for name in ("pkg_a/a.h", "stray.h"):
            with open(os.path.join(site, name), "w") as f:
                f.write("static int %s(void) { return 0; }\n" % name[-3])
        with open(os.path.join(site, "pkg_a-1.0.dist-info", "METADATA"), "w") as f:
            f.write("Metadata-Version: 2.1\nName: pkg_a\nVersion: 1.0\n\nA package.\n")
        with open(os.path.join(site, "pkg_a-1.0.dist-info", "RECORD"), "w") as f:
            f.write("pkg_a/a.h,sha256=x,36\npkg_a-1.0.dist-info/METADATA,,\n")
        os.symlink("/usr/include/zlib.h", os.path.join(outside, "handmade.h"))
        with open(os.path.join(outside, "out.c"), "w") as f:
            f.write("int out(void) { return 0; }\n")
        run(["cc", "-c", "out.c", "-o", "out.o"], cwd=outside)
        run(["ar", "rcs", "libout.a", "out.o"], cwd=outside)
        run(["git", "init", "-q", src])
        run(["git", "-C", src, "add", "inside.h"])
        locks = {  # the cases' deploy/python-constraints.txt (none: empty)
            "a pip package at its locked version": {"pkg-a": "1.0"},
            "a pip package at another version than the lock's": {"pkg-a": "2.0"},
            "a virtualenv file of no pip package": {"pkg-a": "1.0"},
        }
        cases = [  # name, header, flags, packages, verdict, words the report must hold
            ("a header of the tree", '"inside.h"', "", "build-essential", 0, []),
            ("a header outside the tree", '"outside.h"', "", "build-essential", 1,
             [os.path.join(outside, "outside.h"), "in no Debian package"]),
            ("a library outside the tree", '"inside.h"', "-L%s -lout" % outside,
             "build-essential", 1, [os.path.join(outside, "libout.a"), "found for -lout"]),
            ("a virtualenv's link out of it", '"venv.h"', "-I" + venv, "build-essential", 1,
             [os.path.join(venv, "venv.h"), "a link to " + os.path.join(outside, "outside.h")]),
            ("a hand-made link to a package's file", '"handmade.h"', "", "build-essential," + zlib,
             1, [os.path.join(outside, "handmade.h"), "in no Debian package"]),
            ("a package not installed by install-deps", "<zlib.h>", "-lz", "build-essential", 1,
             ["/usr/include/zlib.h", "found for -lz", "from " + zlib]),
            ("the same package installed", "<zlib.h>", "-lz", "build-essential," + zlib, 0, []),
            ("a -D macro naming a file of no package", '"inside.h"',
             "-DWHERE=%s/outside.h" % outside, "build-essential", 0, []),
            ("under an LD_LIBRARY_PATH", '"inside.h"', "", "build-essential", 0, []),
            ("a pip package at its locked version", '"pkg_a/a.h"', "-I" + site,
             "build-essential", 0, ["and 1 from 1 pip packages"]),
            ("a pip package at another version than the lock's", '"pkg_a/a.h"', "-I" + site,
             "build-essential", 1, [os.path.join(site, "pkg_a/a.h"), "pkg-a 1.0",
                                    "pins at 2.0"]),
            ("a pip package the lock does not name", '"pkg_a/a.h"', "-I" + site,
             "build-essential", 1, ["pkg-a 1.0, which deploy/python-constraints.txt does not "
                                    "name", "note: the virtualenv has pip packages"]),
            ("a virtualenv file of no pip package", '"stray.h"', "-I" + site,
             "build-essential", 1, [os.path.join(site, "stray.h"), "in no pip package"]),
        ]
        for i, (name, header, flags, packages, verdict, words) in enumerate(cases):
            build = os.path.join(t, "build%d" % i)
            os.makedirs(build)
            with open(os.path.join(src, "a%d.c" % i), "w") as f:
                f.write("#include %s\nint main(void) { return 0; }\n" % header)
            run(["git", "-C", src, "add", "a%d.c" % i])
            cflags = " ".join(w for w in flags.split() if w.startswith(("-I", "-D")))
            libs = " ".join(w for w in flags.split() if w.startswith(("-L", "-l")))
            with open(os.path.join(build, "build.ninja"), "w") as f:
                f.write("rule cc\n  command = cc -MD -MF $out.d -I%s %s -c $in -o $out\n"
                        "  depfile = $out.d\n  deps = gcc\n"
                        "rule link\n  command = cc $in -o $out %s\n"
                        "build a.o: cc %s/a%d.c\nbuild a: link a.o\n"
                        % (outside, cflags, libs, src, i))
            run(["ninja", "-C", build])
            saved = os.environ.get("LD_LIBRARY_PATH")
            if name.startswith("under an LD_LIBRARY_PATH"):
                # A copy of the C library in a folder of no package, first on the loader's path.
                libc = re.search(r"libc\.so\.6 => (\S+)", run(["ldd", os.path.join(build, "a")]))
                shutil.copy(libc.group(1), os.path.join(outside, "libc.so.6"))
                os.environ["LD_LIBRARY_PATH"] = outside
            try:
                rc, lines = check(build, src, venv, packages.split(","), locks.get(name, {}))
            finally:
                if saved is None:
                    os.environ.pop("LD_LIBRARY_PATH", None)
                else:
                    os.environ["LD_LIBRARY_PATH"] = saved
            text = "\n".join(lines)
            ok = rc == verdict and all(w in text for w in words)
            failures += not ok
            print("self-test: %s: %s (exit %d, want %d)" % (name, "ok" if ok else "WRONG", rc,
                                                            verdict))
            if not ok:
                print(text)
    return 1 if failures else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build", nargs="?", help="a finished Ninja build folder")
    ap.add_argument("--venv", default=os.environ.get("IMAGEGEN_VENV", "/opt/imagegen/venv"),
                    help="install-deps' virtualenv (its files are install-deps' own)")
    ap.add_argument("--packages", default="",
                    help="the Debian packages a fresh machine gets (default: install-deps')")
    ap.add_argument("--repo", help="the source tree (default: the build's, from CMakeCache.txt)")
    ap.add_argument("--python-lock",
                    help="the virtualenv's pip versions (default: the tree's "
                         "deploy/python-constraints.txt)")
    ap.add_argument("--self-test", action="store_true",
                    help="check the check on a small project of its own and stop")
    args = ap.parse_args()
    if not shutil.which("dpkg-query") or not os.path.isdir("/var/lib/dpkg/info"):
        print("check_build_inputs: no dpkg here; nothing checked", file=sys.stderr)
        return 2
    try:
        if args.self_test:
            return self_test()
        if not args.build:
            ap.error("the build folder is needed (or --self-test)")
        build = os.path.abspath(args.build)
        repo = args.repo
        if not repo:
            with open(os.path.join(build, "CMakeCache.txt"), encoding="utf-8") as f:
                repo = re.search(r"^CMAKE_HOME_DIRECTORY:INTERNAL=(.*)$", f.read(), re.M).group(1)
        roots = [p for p in args.packages.split(",") if p] or install_deps_packages(repo)
        lock = read_lock(args.python_lock or os.path.join(repo, "deploy/python-constraints.txt"))
        rc, lines = check(build, os.path.abspath(repo), args.venv, roots, lock)
    except (CannotCheck, OSError, AttributeError) as e:
        print("check_build_inputs: cannot check: %s" % e, file=sys.stderr)
        return 2
    print("\n".join(lines))
    return rc


if __name__ == "__main__":
    sys.exit(main())
