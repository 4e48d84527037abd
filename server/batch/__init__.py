"""Offline batch jobs: OpenAI batch-format JSONL in, one answer line per request line out.

``radixserve-batch -i requests.jsonl -o results.jsonl --model DIR`` runs every line through the
server's own app in-process (no sockets): the same body schemas, tokenization, scheduler and
runner answer each line exactly as ``POST url`` would on a running server. Over the server it
adds corpus-wide prefix grouping (lines ordered by their token prefix within a window, so shared
prefixes meet in one batch), resumable output and a progress display. Modules, one concept each:

- ``lines``: reading the input file and the shapes of the output lines;
- ``grouping``: the order in which a window of lines is run;
- ``inprocess``: the in-process app a line is dispatched to (``Engine``);
- ``output``: chunked, fsynced writing and resuming from an earlier run's output;
- ``progress``: the terminal progress line or plain log lines;
- ``job``: the loop that ties them together; ``command``: ``main(argv)``, the console script;
- ``ray_data``: the same job on Ray actors, one engine each, blocks dealt round-robin.
"""
