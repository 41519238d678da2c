"""Reference trainers: each declares its state through the interop adapter."""
