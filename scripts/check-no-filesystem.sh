#!/usr/bin/env bash
# Fails if an ELF file dtrain built imports a std::filesystem symbol.
# Design note [no std::filesystem] (include/dtrain/util/fs.h): the pytorch.org/pip libtorch exports
# its own static libstdc++'s std::filesystem (pytorch/pytorch#133437); a call that binds to that copy
# can crash (std::filesystem::remove_all did, in dtrain-gpt and the tests). dtrain uses
# dtrain::util::fs instead, and this check (CTest: elf.no_std_filesystem) keeps it that way.
#   scripts/check-no-filesystem.sh DIR...   every ELF file (executable, shared object, archive,
#                                           object) found under the DIRs
set -euo pipefail
if (($# == 0)); then
  echo "usage: $0 DIR..." >&2
  exit 2
fi
command -v nm >/dev/null || { echo "check-no-filesystem: nm not found (install binutils)" >&2; exit 2; }
pattern='std::(__cxx11::|experimental::)?(__fs::)?filesystem::'
checked=0
bad=0
while IFS= read -r -d '' f; do
  [[ "$(head -c 4 "$f" 2>/dev/null | od -An -c | tr -d ' ')" == '177ELF' || "$f" == *.a ]] || continue
  checked=$((checked + 1))
  case "$f" in
    *.a|*.o) syms=$(nm --undefined-only -C "$f" 2>/dev/null | grep -E "$pattern" || true) ;;
    *) syms=$(nm -D --undefined-only -C "$f" 2>/dev/null | grep -E "$pattern" || true) ;;
  esac
  if [[ -n "$syms" ]]; then
    bad=$((bad + 1))
    echo "check-no-filesystem: $f imports std::filesystem (binds to libtorch's own copy in pip/pytorch.org builds, pytorch#133437); use dtrain/util/fs.h:"
    echo "$syms" | sed 's/^/    /' | head -20
  fi
done < <(find "$@" -type f \( -perm -u+x -o -name '*.so' -o -name '*.so.*' -o -name '*.a' \) -print0)
if ((checked == 0)); then
  echo "check-no-filesystem: no ELF files under $* (build first)" >&2
  exit 2
fi
if ((bad)); then
  echo "check-no-filesystem: $bad of $checked ELF files import std::filesystem" >&2
  exit 1
fi
echo "check-no-filesystem: $checked ELF files, none imports std::filesystem"
