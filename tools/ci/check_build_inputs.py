#!/usr/bin/env python3
"""Fails if a build read a system file that a fresh Debian machine would not have.

The README promises that deploy/install-deps.sh on a fresh bookworm is all the set-up there is.
CI runs on a machine that has more (a system CUDA toolkit under /usr/local, whose headers it
links into /usr/local/include, among them), and a build that reads one of those files passes
CI and fails for every user: cuda_fp16.h found CCCL's <nv/target> that way from 2026-11-29 to
2026-12-03 (docs/results-deploy.md). This check reads what a finished Ninja build used:

  - every header of every compiled file (`ninja -t deps`, the compilers' depfiles, nvcc's too),
  - every absolute file path in the build's commands (compilers, protoc and its plugins,
    libraries linked by path),
  - every `-lNAME` of a link line, found where the linker finds it (the line's -L
    folders, the compiler's with LIBRARY_PATH's, the linker's own),
  - every shared library the built programs load (`ldd`),

and requires each file outside the source tree, the build folder and install-deps' virtualenv
to belong to a Debian package that a fresh machine has after install-deps: a package the script
installs, one those depend on (Depends and Pre-Depends, recursively; not Recommends, which it
does not install), or the base system (Essential or Priority required, and apt). A file in no
package (/usr/local, a hand-made link) or in another package fails, with the package named.
Exit 0 when clean, 1 with the offending files listed, 2 when it cannot check (no dpkg).

  tools/ci/check_build_inputs.py BUILD_DIR [--venv DIR] [--packages P,Q,...]
  tools/ci/check_build_inputs.py --self-test
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile


def norm(path):
    return os.path.normpath(path)


def aliases(path):
    """The path, and the same file under merged /usr (/lib and /usr/lib are one folder)."""
    out = [path]
    for top in ("/lib/", "/lib64/", "/bin/", "/sbin/"):
        if path.startswith(top):
            out.append("/usr" + path)
        elif path.startswith("/usr" + top):
            out.append(path[len("/usr"):])
    return out


def dpkg_owners():
    """Path -> the set of installed packages whose file lists name it."""
    owners = {}
    for lst in glob.glob("/var/lib/dpkg/info/*.list"):
        pkg = os.path.basename(lst)[:-len(".list")].split(":")[0]
        with open(lst, encoding="utf-8", errors="replace") as f:
            for line in f:
                p = line.rstrip("\n")
                if p:
                    owners.setdefault(p, set()).add(pkg)
    return owners


def installed_packages():
    """Package -> (essential, priority, [dependency alternatives], [provided names])."""
    fmt = ("${Package}\t${Status}\t${Essential}\t${Priority}\t${Pre-Depends}\t${Depends}\t"
           "${Provides}\n")
    text = subprocess.run(["dpkg-query", "-W", "-f=" + fmt], check=True,
                          capture_output=True, text=True).stdout
    pkgs = {}
    for line in text.splitlines():
        name, status, essential, priority, pre, dep, provides = (line.split("\t") + [""] * 7)[:7]
        if "installed" not in status.split():
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
    out = subprocess.run(["bash", os.path.join(repo, "deploy/install-deps.sh"), "--list-packages"],
                         check=True, capture_output=True, text=True).stdout
    return out.split()


PATH_RE = re.compile(r'(?:^|[\s=",:;\'])(/[A-Za-z0-9_.+@%/-]+)')


def build_inputs(build):
    """The files the build read: (path, what read it)."""
    found = {}

    def add(path, why):
        path = norm(path if os.path.isabs(path) else os.path.join(build, path))
        if os.path.isfile(path):
            found.setdefault(path, why)

    deps = subprocess.run(["ninja", "-C", build, "-t", "deps"], check=True, capture_output=True,
                          text=True).stdout
    target = None
    for line in deps.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            target = line.split(":")[0]
        else:
            add(line.strip(), "a header of " + str(target))
    commands = subprocess.run(["ninja", "-C", build, "-t", "commands"], check=True,
                              capture_output=True, text=True).stdout
    # -lNAME as the linker finds it: the line's -L folders, then the compiler's (LIBRARY_PATH's
    # first), then the linker's own; in each, libNAME.so before libNAME.a.
    cxx = shutil.which("c++") or "c++"
    dirs = subprocess.run([cxx, "-print-search-dirs"], capture_output=True, text=True).stdout
    dirs = [d for line in dirs.splitlines() if line.startswith("libraries: =")
            for d in line[len("libraries: ="):].split(":")]
    ld = subprocess.run(["ld", "--verbose"], capture_output=True, text=True).stdout
    dirs += [d.lstrip("=") for d in re.findall(r'SEARCH_DIR\("([^"]+)"\)', ld)]
    for line in commands.splitlines():
        for m in PATH_RE.finditer(line):
            add(m.group(1), "named in a build command")
        line_dirs = re.findall(r"(?:^|\s)-L(\S+)", line) + dirs
        for lib in re.findall(r"(?:^|\s)-l(\S+)", line):
            names = [lib[1:]] if lib.startswith(":") else ["lib%s.so" % lib, "lib%s.a" % lib]
            hits = [os.path.join(d, n) for d in line_dirs for n in names
                    if os.path.isfile(os.path.join(d, n))]
            if hits:
                add(hits[0], "found for -l" + lib)
    # Programs and shared libraries built: what they load at run time.
    for root, dirs, files in os.walk(build):
        dirs[:] = [d for d in dirs if d not in ("CMakeFiles", "Testing")]
        for f in files:
            p = os.path.join(root, f)
            if os.path.islink(p) or not os.access(p, os.X_OK) and not f.endswith(".so"):
                continue
            with open(p, "rb") as fh:
                if fh.read(4) != b"\x7fELF":
                    continue
            r = subprocess.run(["ldd", p], capture_output=True, text=True)
            for m in re.finditer(r"=>\s+(/\S+)", r.stdout):
                add(m.group(1), "loaded by " + os.path.relpath(p, build))
    return found


def check(build, repo, venv, roots):
    """(exit status, report lines) for the Ninja build folder `build`."""
    pkgs = installed_packages()
    allowed = allowed_closure(roots, pkgs)
    owners = dpkg_owners()
    own = {norm(p(d)) for d in (repo, build, venv) for p in (os.path.realpath, os.path.abspath)}
    inputs = build_inputs(build)
    bad, used, system = [], set(), 0
    for path, why in sorted(inputs.items()):
        real = norm(os.path.realpath(path))
        if any(f == d or f.startswith(d + "/") for f in (path, real) for d in own):
            continue
        system += 1
        # The package of the path as used (a development link such as libz.so is zlib1g-dev's,
        # whatever the file it leads to) or, for a link of no package such as /usr/bin/c++
        # (through /etc/alternatives), of the file it leads to; not under /usr/local.
        who = set().union(*(owners.get(c, set()) for c in aliases(path)))
        if not who and not path.startswith("/usr/local/"):
            who = set().union(*(owners.get(c, set()) for c in aliases(real)))
        if not who:
            bad.append("%s (%s): in no Debian package%s"
                       % (path, why, "" if real == path else ", a link to " + real))
        elif not who & allowed:
            bad.append("%s (%s): from %s, which install-deps does not install"
                       % (path, why, ", ".join(sorted(who))))
        else:
            used |= who & allowed
    if bad:
        return 1, ["check_build_inputs: %d of the %d system files this build read would be missing "
                   "on a fresh Debian machine after deploy/install-deps.sh:" % (len(bad), system)
                   ] + ["  " + b for b in bad]
    return 0, ["check_build_inputs: %d files read, %d of them system files, each from one of the "
               "%d Debian packages install-deps gives a fresh machine (%d of those packages used)"
               % (len(inputs), system, len(allowed), len(used))]


def self_test():
    """The check on a two-file Ninja project (a header included, a library linked), each case
    with the verdict it must give: a header from the tree passes; a header or a library from
    elsewhere and a package's header and library the given packages do not cover fail, naming
    the file (and the package); the same package named passes. 0 when every case gives its
    verdict."""
    zlib = subprocess.run(["dpkg", "-S", "/usr/include/zlib.h"], capture_output=True, text=True)
    if zlib.returncode != 0:
        print("self-test: /usr/include/zlib.h is in no installed package (install-deps installs "
              "it with libpng-dev)")
        return 1
    zlib_pkg = zlib.stdout.split(":")[0]
    failures = 0
    with tempfile.TemporaryDirectory() as t:
        src, outside = os.path.join(t, "src"), os.path.join(t, "outside")
        for d in (src, outside):
            os.makedirs(d)
        with open(os.path.join(src, "inside.h"), "w") as f:
            f.write("static int inside(void) { return 0; }\n")
        with open(os.path.join(outside, "outside.h"), "w") as f:
            f.write("static int outside(void) { return 0; }\n")
        with open(os.path.join(outside, "out.c"), "w") as f:
            f.write("int out(void) { return 0; }\n")
        subprocess.run(["cc", "-c", "out.c", "-o", "out.o"], cwd=outside, check=True)
        subprocess.run(["ar", "rcs", "libout.a", "out.o"], cwd=outside, check=True)
        cases = [  # name, header, libs, packages, verdict, words the report must hold
            ("tree header", '"inside.h"', "", "build-essential", 0, []),
            ("header outside the tree", '"outside.h"', "", "build-essential", 1,
             [os.path.join(outside, "outside.h"), "in no Debian package"]),
            ("a library outside the tree", '"inside.h"', "-L%s -lout" % outside,
             "build-essential", 1, [os.path.join(outside, "libout.a"), "found for -lout"]),
            ("a package not installed by install-deps", "<zlib.h>", "-lz", "build-essential", 1,
             ["/usr/include/zlib.h", "found for -lz", "from " + zlib_pkg]),
            ("the same package installed", "<zlib.h>", "-lz", "build-essential," + zlib_pkg, 0,
             []),
        ]
        for i, (name, header, libs, packages, verdict, words) in enumerate(cases):
            build = os.path.join(t, "build%d" % i)
            os.makedirs(build)
            with open(os.path.join(src, "a%d.c" % i), "w") as f:
                f.write("#include %s\nint main(void) { return 0; }\n" % header)
            with open(os.path.join(build, "build.ninja"), "w") as f:
                f.write("rule cc\n  command = cc -MD -MF $out.d -I%s -c $in -o $out\n"
                        "  depfile = $out.d\n  deps = gcc\n"
                        "rule link\n  command = cc $in -o $out %s\n"
                        "build a.o: cc %s/a%d.c\nbuild a: link a.o\n" % (outside, libs, src, i))
            subprocess.run(["ninja", "-C", build], check=True, capture_output=True)
            rc, lines = check(build, src, os.path.join(t, "no-venv"), packages.split(","))
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
    ap.add_argument("--repo", help="the source tree (default: this script's)",
                    default=os.path.dirname(os.path.dirname(os.path.dirname(
                        os.path.abspath(__file__)))))
    ap.add_argument("--self-test", action="store_true",
                    help="check the check on a small project of its own and stop")
    args = ap.parse_args()
    if not shutil.which("dpkg-query") or not os.path.isdir("/var/lib/dpkg/info"):
        print("check_build_inputs: no dpkg here; nothing checked", file=sys.stderr)
        return 2
    if args.self_test:
        return self_test()
    if not args.build:
        ap.error("the build folder is needed (or --self-test)")
    roots = [p for p in args.packages.split(",") if p] or install_deps_packages(args.repo)
    rc, lines = check(os.path.abspath(args.build), args.repo, args.venv, roots)
    print("\n".join(lines))
    return rc


if __name__ == "__main__":
    sys.exit(main())
