#!/usr/bin/env bash
# Builds ardit's images with podman where public registries are out of reach (this project's sandboxed
# development machines): the bases are made from Debian's packages (mmdebstrap, podman import) and passed as the
# Dockerfiles' BASE; this machine's pip sources go in as build secrets and a build context (pip's index URLs, the
# CA bundle pip trusts, a local wheel folder), never into a layer or a Dockerfile default.
#
#   deploy/docker/build_image.sh [cpu] [gpu] [prometheus]     (none: cpu prometheus, what the CPU stack runs)
#
# Needs podman, mmdebstrap (Debian packages) and root. ARDIT_BUILD_WHEELS: a folder of wheels pip may take
# (default: pip's find-links when it is a local folder; this is where torch's +cpu build comes from here).
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
suite=bookworm
plain_base=localhost/ardit-base:$suite
python_base=localhost/ardit-base-python3.11:$suite
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(cpu prometheus)

# A Debian root file system as an image, standing in for debian:bookworm-slim or python:3.11-slim-bookworm.
make_base() {
    local image=$1 packages=$2 tmp
    podman image exists "$image" && return
    tmp=$(mktemp -d)
    mmdebstrap --quiet --variant=minbase --include="$packages" "$suite" "$tmp/rootfs.tar"
    podman import --quiet --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' "$tmp/rootfs.tar" "$image" >/dev/null
    rm -rf "$tmp"
    echo "made $image from Debian $suite packages"
}

pip_setting() {
    python3 -m pip config list 2>/dev/null | sed -n "s/^global\.$1='\(.*\)'$/\1/p" | head -1
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The build's pip.conf: this machine's network indexes (file:// ones are paths here), no local paths.
{
    echo "[global]"
    index=$(pip_setting index-url)
    if [[ $index == http* ]]; then echo "index-url = $index"; fi
    extra=()
    for url in ${PIP_EXTRA_INDEX_URL:-$(pip_setting extra-index-url)}; do
        if [[ $url == http* ]]; then extra+=("$url"); fi
    done
    if [ ${#extra[@]} -gt 0 ]; then echo "extra-index-url = ${extra[*]}"; fi
    echo "timeout = 60"
} > "$work/pip.conf"
pip_secrets=(--secret "id=pipconf,src=$work/pip.conf")
cert=${PIP_CERT:-$(pip_setting cert)}
if [ -f "$cert" ]; then pip_secrets+=(--secret "id=cabundle,src=$cert"); fi
wheels=${ARDIT_BUILD_WHEELS:-${PIP_FIND_LINKS:-$(pip_setting find-links)}}
wheels=${wheels%% *}

build() {
    local tag=$1 dockerfile=$2 base=$3 context=$4
    shift 4
    echo "building $tag"
    # nice: the build shares the machine's cores.
    nice -n 10 podman build --network=host --build-arg "BASE=$base" -f "$dockerfile" -t "$tag" "$@" "$context"
}

for target in "${targets[@]}"; do
    case $target in
        cpu | gpu)
            make_base "$python_base" ca-certificates,python3.11,python3.11-venv
            extra_context=()
            # A +cpu torch in the wheel folder would satisfy the GPU image's torch==2.13.0 and win.
            if [ "$target" = cpu ] && [ -d "$wheels" ]; then extra_context=(--build-context "wheels=$wheels"); fi
            build "ardit:$target" "$root/deploy/docker/Dockerfile.$target" "$python_base" "$root" \
                "${pip_secrets[@]}" "${extra_context[@]}"
            ;;
        prometheus)
            make_base "$plain_base" ca-certificates
            build ardit-prometheus:$suite "$root/deploy/docker/Dockerfile.prometheus" "$plain_base" "$root/deploy/docker"
            ;;
        *)
            echo "unknown image '$target' (cpu, gpu, prometheus)" >&2
            exit 2
            ;;
    esac
done
podman images | grep -E "^(REPOSITORY|localhost/ardit)"
