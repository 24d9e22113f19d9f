#!/usr/bin/env bash
# make-repos.sh MIRRORS OUT: the repositories of the SWE-bench Verified rows CI and the parity bench
# run besides flask, each a bare repository holding only those rows' base_commit trees (no later
# history), written to OUT/owner__name (what `--repos OUT` finds). MIRRORS/owner+name/repo are full
# bare clones of the public repositories (github.com/owner/name; any full clone holding the commits
# gives the same trees: a commit id names its tree). See PROVENANCE.md.
#
# depth 2: base_commit, its tree and its parents (so the eval script's `git show` shows the commit,
# not the whole tree as new files), nothing older. pytest's version comes from
# `git describe` (setuptools_scm), so its repository also holds the history since its last release
# tag before base_commit and that tag (an ancestor of base_commit: nothing later).
set -euo pipefail
mirrors=$1; out=$2
git_() { git -c protocol.file.allow=always "$@"; }
one() {  # one REPO TAGGED COMMIT...
  local repo=$1 tagged=$2; shift 2
  local src="$mirrors/${repo/\//+}/repo" dst="$out/${repo/\//__}"
  rm -rf "$dst"; git init -q --bare "$dst"
  for c in "$@"; do
    if [ "$tagged" = 1 ]; then
      local tag since
      tag=$(git -C "$src" describe --tags --abbrev=0 "$c")
      since=$(git -C "$src" log -1 --format=%cI "$tag^{commit}")
      # a day before the tag's commit: --shallow-since keeps commits newer than the date only
      since=$(date -u -d "$since - 1 day" +%Y-%m-%dT%H:%M:%SZ)
      git_ -C "$dst" fetch -q --no-tags --shallow-since="$since" "$src" "$c:refs/heads/base-$c" \
        "refs/tags/$tag:refs/tags/$tag"
      git -C "$dst" merge-base --is-ancestor "$tag" "$c"
    else
      git_ -C "$dst" fetch -q --no-tags --depth 2 "$src" "$c:refs/heads/base-$c"
    fi
  done
  git -C "$dst" symbolic-ref HEAD "refs/heads/base-$1"
  git -C "$dst" gc -q --aggressive --prune=now
  # loose refs (git needs refs/ to exist; a checkout of this repository cannot hold empty folders)
  git -C "$dst" for-each-ref --format='%(objectname) %(refname)' | while read -r oid ref; do
    mkdir -p "$dst/$(dirname "$ref")"; echo "$oid" > "$dst/$ref"
  done
  rm -rf "$dst/packed-refs" "$dst/hooks" "$dst/info" "$dst/logs" "$dst/description" "$dst/FETCH_HEAD"
  git -C "$dst" fsck --no-progress --connectivity-only
  du -sh "$dst"
}
one psf/requests 0 39d0fdd9096f7dceccbc8f82e1eda7dd64717a8e            # psf__requests-5414
one pytest-dev/pytest 1 e6e300e729dd33956e5448d8be9a0b1540b4e53a       # pytest-dev__pytest-7432
one sympy/sympy 0 c807dfe7569692cad24f02a08477b70c1679a4dd                                               # sympy__sympy-12481
one pylint-dev/pylint 0 40cc2ffd7887959157aaf469e09585ec2be7f528                                        # pylint-dev__pylint-4970
one sphinx-doc/sphinx 0 82ef497a8c88f0f6e50d84520e7276bfbf65025d                                        # sphinx-doc__sphinx-8721
one mwaskom/seaborn 0 54cab15bdacfaa05a88fbc5502a5b322d99f148e                                         # mwaskom__seaborn-3069
one django/django 0 37c5b8c07be104fd5288cd87f101e48cb7a40298                                         # django__django-15863
