#!/bin/sh
# Usage: phase.sh NAME COMMAND [ARG...]: runs COMMAND, then appends "NAME  SECONDS s  exit STATUS" to $PHASE_LOG
# (default .phase-times) and prints it; exits with COMMAND's status. The Makefile runs each phase of `make test`
# under it; .ci/run prints the table at the end.
name=$1
shift
start=$(date +%s)
"$@"
status=$?
line=$(printf '%-44s %6d s   exit %d' "$name" $(( $(date +%s) - start )) "$status")
echo "$line" >> "${PHASE_LOG:-.phase-times}"
echo "== phase: $line"
exit "$status"
