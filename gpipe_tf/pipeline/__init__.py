"""The pipeline: partition the layers into cells (`partition`), split the batch into
micro-batches (`microbatch`), order the work (`schedule`), run it in the graph (`executor`) with
re-materialization (`recompute`) on the devices that `devices` chooses; `pipelining_layer`
assembles them into `PipeliningLayer`."""
