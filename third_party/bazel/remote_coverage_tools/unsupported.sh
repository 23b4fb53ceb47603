#!/bin/sh
echo "remote_coverage_tools is an offline stub; 'bazel coverage' is not supported." >&2
exit 1
