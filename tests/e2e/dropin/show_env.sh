#!/bin/sh
# What a rank of a program started with --no-python sees: its arguments and its place.
echo "SH rank=$RANK local=$LOCAL_RANK of $LOCAL_WORLD_SIZE args=$*"
