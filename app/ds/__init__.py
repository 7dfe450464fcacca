"""The DeepSpeed JSON (config.py checks it, auto.py fills its "auto", precision.py resolves its precision) and every touch of DeepSpeed's and torch's private internals (internals/)."""
