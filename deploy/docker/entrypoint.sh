#!/bin/sh
# Container entry point: run `conveyor start --foreground` on the KServe model-directory layout.
#
#   $CONVEYOR_MODEL_DIR (default /mnt/models)/config/config.properties   the server config, if present
#                                                /model-store/                 the archives, if present
#
# Arguments are `conveyor start` flags. KServe's TorchServe runtime arguments work too
# ("torchserve --start --model-store=... --ts-config=..."): the leading program name and --start
# are dropped. A --ts-config/--config or --model-store given here wins over the layout, and
# TS_CONFIG_FILE over both (Conveyor's own rule). Without a mounted config the image's
# /etc/conveyor/config.properties is used. `exec` keeps Conveyor the process that receives SIGTERM.
set -eu

model_dir="${CONVEYOR_MODEL_DIR:-/mnt/models}"
default_config="${CONVEYOR_DEFAULT_CONFIG:-/etc/conveyor/config.properties}"

case "${1:-}" in
    torchserve|conveyor) shift ;;
esac
if [ "${1:-}" = "start" ]; then
    shift
fi

has_config=no
has_store=no
for arg do
    shift
    case "$arg" in
        --start|--foreground) continue ;;
        --ts-config|--ts-config=*|--config|--config=*) has_config=yes ;;
        --model-store|--model-store=*) has_store=yes ;;
    esac
    set -- "$@" "$arg"
done

if [ "$has_store" = no ] && [ -d "$model_dir/model-store" ]; then
    set -- --model-store "$model_dir/model-store" "$@"
fi
if [ "$has_config" = no ]; then
    if [ -f "$model_dir/config/config.properties" ]; then
        set -- --ts-config "$model_dir/config/config.properties" "$@"
    else
        set -- --ts-config "$default_config" "$@"
    fi
fi

exec conveyor start --foreground "$@"
