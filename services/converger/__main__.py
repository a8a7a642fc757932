from services.converger.service import main

main()
