"""bcd's services: one package and one OS process each, talking over the node bus."""
