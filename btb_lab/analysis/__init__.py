"""Statistics over stored records: metric definitions, request classes, the verdict engine."""
