"""Images and video through mlx-vlm, beside the text path (see `loading`, `media`, `parts`,
`prepare`, `vision`, `job`)."""
