"""Quality measurement: perplexity through the engine's paged path, and teacher-forced comparison of
one KV cache dtype against another (``kvserve eval ppl``)."""
