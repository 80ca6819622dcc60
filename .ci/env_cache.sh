# Sourced by the CI jobs that build an environment of their own: where it lives, outside the clone, once per set of
# versions, reused by later runs and clones: $ULTRAMEM_CI_CACHE (default ~/.cache/ultramem-ci)/NAME-<hash of VERSIONS>.
cached_env() {  # cached_env NAME VERSIONS
    echo "${ULTRAMEM_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ultramem-ci}/$1-$(echo "$2" | sha1sum | cut -c1-12)"
}
